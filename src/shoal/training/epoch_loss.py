"""The epoch's training loss: its sum and batch count since the epoch began, kept across a
mid-epoch resume, so that a resumed epoch reports what the epoch without the stop reports.

Each rank adds its micro-batches' losses in float64; the epoch's figure is the sum over the
ranks divided by the count. A checkpoint saved mid-epoch keeps the sums of every rank so
far (one all-reduce at the save) and how many micro-batches a step adds over the ranks
(processes x accumulation); on resume, rank 0 starts from them and the others from zero, so
the end-of-epoch all-reduce gives the same totals. Resumed with another number of processes
or accumulation, the sums are scaled to the new count a step (exact where the ratio is a
power of two). Losses are float32 or narrower, and float64 holds their sums exactly, in any
order of the additions, while the largest loss over the smallest, times the micro-batches a
rank adds, stays under 2**29 (losses from 0.001 to 10 over 30,000 micro-batches): then the
figure is bitwise the one of the run without the stop; beyond, its last bits may differ.

In a live job a step's losses are summed apart (from ``mark``) and travel with its average
across the replica groups (``step_sum``, then ``take_step``), so that rank r of every group
holds the sums of rank r of all groups, the figure DDP over all of them reports; a step that
does not commit is done again, and its losses are dropped (``rewind``). A replacement that
heals takes a live group's sums with its state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


def per_step(world_size: int, replica_groups: int, accumulate: int) -> int:
    """Micro-batches a step adds to the sums over the ranks: every group's, in a live job
    (its steps' losses travel with the average across groups)."""
    return world_size * replica_groups * accumulate


class Carried(NamedTuple):
    """An epoch's loss over every rank when a checkpoint was saved inside it."""

    sum: float
    batches: int
    per_step: int  # micro-batches a step added over the ranks (processes x accumulation)


class EpochLoss:
    """This rank's loss sum and micro-batch count since the epoch began."""

    def __init__(self, device: torch.device, carried: Carried | None = None,
                 per_step: int = 1):
        """``carried``: the totals of every rank when the epoch was saved (rank 0 only);
        ``per_step``: the micro-batches a step adds over the ranks now."""
        total, batches = 0.0, 0
        if carried is not None:
            scale = per_step / carried.per_step
            total, batches = carried.sum * scale, round(carried.batches * scale)
        self._sum = torch.full((), total, device=device, dtype=torch.float64)
        self._host: float | None = None
        """A live job's sum since its first committed step, added on the host in the same
        order (a step's sum comes to the host already); ``_sum`` is then behind."""
        self.batches = batches
        self._marked: int | None = None  # the batches at a live step's start (``mark``)
        self._step: list[torch.Tensor] = []  # that step's own losses so far

    def add(self, loss: torch.Tensor) -> None:
        self.batches += 1
        if self._marked is None:
            self.sum.add_(loss.detach())
        else:  # a live step's: summed at its end (``step_sum``)
            self._step.append(loss.detach())

    def mark(self) -> None:
        """A live step starts: its losses are kept apart until ``take_step`` (a step that
        does not commit drops them: ``rewind``)."""
        self._marked, self._step = self.batches, []

    def step_sum(self, coming: torch.Tensor | None = None) -> tuple[float, int]:
        """This rank's losses since ``mark``, summed in float64 in their order, and their
        micro-batches, with the loss ``coming`` (not added yet) when given."""
        assert self._marked is not None  # after mark
        losses = self._step if coming is None else [*self._step, coming.detach()]
        # float32 and narrower: exact in float64 (one read from an accelerator for all)
        values = (torch.stack(losses).double().tolist() if len(losses) > 1
                  else [float(loss) for loss in losses])
        total = 0.0
        for value in values:
            total += value
        return total, self.batches - self._marked + (coming is not None)

    def take_step(self, total: float, batches: int) -> None:
        """The step's losses of every group (the same rank of each), added to the sums in
        place of this group's own."""
        assert self._marked is not None  # after mark
        if self._host is None:
            self._host = float(self._sum)
        self._host += total
        self.batches = self._marked + batches
        self._marked, self._step = None, []

    def state(self) -> list:
        """[sum, batches]: what a replacement group takes over."""
        return [self._host if self._host is not None else float(self._sum), self.batches]

    @property
    def sum(self) -> torch.Tensor:
        """The sum of this rank's losses (float64, on its device)."""
        if self._host is not None:
            self._sum.fill_(self._host)
            self._host = None
        return self._sum

    @classmethod
    def taken_over(cls, device: torch.device, state: list) -> EpochLoss:
        """A live group's sums (see ``state``), with nothing marked."""
        loss = cls(device)
        loss.sum.fill_(state[0])
        loss.batches = int(state[1])
        return loss

    def rewind(self) -> None:
        """Drop the losses of the step under way since ``mark`` (none: as they are)."""
        if self._marked is not None:
            self.batches = self._marked
            self._marked, self._step = None, []

    def totals(self, world_size: int) -> tuple[float, int]:
        """(sum, count) over every rank. Collective where ``world_size`` > 1."""
        both = torch.stack([self.sum, torch.tensor(float(self.batches), device=self.sum.device,
                                                   dtype=torch.float64)])
        if world_size > 1:
            dist.all_reduce(both)
        total, batches = both.tolist()
        return total, int(batches)

    def mean(self, world_size: int) -> float:
        """The epoch's loss over every rank's micro-batches (nan without any). Collective
        where ``world_size`` > 1."""
        total, batches = self.totals(world_size)
        return total / batches if batches else float("nan")
