"""topk's gather across groups (``shoal.ft.across.TopKAcrossGroups``), without processes:
the step's numbers ride at the end of each group's message and come back summed, whatever
the length of the selection before them (2-byte values and an odd k put them off a
multiple of 4 bytes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.ft.across import TopKAcrossGroups
from shoal.parallel.traffic import Traffic


class _TwoGroups:
    """A quorum of two groups whose other group's message is given: the gather's rows are
    this group's message and that one, as the process group across groups returns them."""

    participants = 2

    def __init__(self, other: torch.Tensor):
        self.other = other

    def start_gather(self, sent, then):
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(then(torch.stack([sent, self.other])))
        return future


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_numbers_come_back_summed_after_any_selection(dtype):
    k = 3  # odd: 2-byte values end at byte 6 + 12 of positions = 18, not a multiple of 4
    payloads = [torch.arange(k * (torch.empty((), dtype=dtype).element_size() + 4),
                             dtype=torch.uint8) + 10 * g for g in range(2)]
    numbers = [torch.tensor([1.5, 0.0, 1.0, 1.0]), torch.tensor([0.0, 2.25, 1.0, 0.0])]
    other = torch.cat([payloads[1], numbers[1].view(torch.uint8)])
    topk = TopKAcrossGroups(nn.Linear(2, 2), 0.5, Traffic())
    topk.replica = _TwoGroups(other)  # type: ignore[assignment]
    carried = topk.carry(numbers[0].tolist())
    assert carried is not None
    rows, groups = topk._gather(payloads[0])
    assert groups == 2
    assert torch.equal(rows.wait(), torch.stack(payloads))
    assert carried.sums() == (numbers[0] + numbers[1]).tolist()
    assert topk.last is not None and torch.equal(topk.last[0], torch.stack(payloads))
