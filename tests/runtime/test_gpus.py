"""NCCL needs a GPU per process: more processes than visible GPUs are refused up front.

The refusal on a real one-GPU machine is tested in tests/gpu; here the count of visible
GPUs is set, since this machine has none.
"""

from __future__ import annotations

import pytest
import torch

from shoal.errors import UsageError
from shoal.runtime.dist import check_gpus


def test_gloo_takes_any_number_of_processes():
    check_gpus("gloo", 64)


def test_nccl_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="needs CUDA"):
        check_gpus("nccl", 1)


@pytest.mark.parametrize("backend", [None, "nccl"])
def test_more_processes_than_gpus_names_both_numbers_and_the_ways_out(monkeypatch, backend):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpus(backend, 1)
    with pytest.raises(UsageError) as refused:
        check_gpus(backend, 2)
    message = str(refused.value)
    assert "\n" not in message
    for part in ("2 processes", "1 is visible", "--nproc-per-node 1", "trainer.backend: gloo"):
        assert part in message, message
