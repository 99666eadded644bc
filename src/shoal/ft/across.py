"""The average across replica groups inside DDP's own reduction (live mode, groups of one
process each, strategy ddp, compression none, fp16 or bf16).

Such a group's model is a DDP model over a process group of its own, and its communication
hook sends each bucket to the same bucket of the other groups, as DDP among R processes
sends it to the other ranks: scaled by 1/R the way DDP's reducer scales a gradient (a
multiplication by 1/R, which differs from a division in the last bit for R = 3), then
summed on the process group the step's quorum configured (gloo's algorithm, over the same
bucket, in the same rank order), and each bucket is on its way while backward computes the
earlier layers' gradients: no copy of the gradients into one buffer after backward. The
step's own numbers (loss sums, quorum flag) ride in the first bucket (``carry``): 2 groups
of one process compute bitwise what 2-process DDP computes; 3 and more, what the same
groups compute without failures (the longer first bucket changes gloo's chunks). Under
fp16 and bf16 the bucket goes in that precision, divided first, as torch's compression
hooks do, and the numbers in an all-reduce of their own.

A sum that fails (a group lost during the step) never raises inside backward: the step is
marked as errored and does not commit (``shoal.ft.session``). Groups of several processes,
and the other strategies and compressions, average after backward instead.

Every group must cut its buckets alike. DDP's first backward in a process sends the whole
model as one bucket, and the next forward cuts the buckets anew, in the order its gradients
became ready. A replacement that heals from a group past its first backward therefore
settles its buckets first: one forward and backward of the step's first micro-batch that
crosses no group and changes nothing (``settle_due``, see ``shoal.training.live``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from shoal.parallel.traffic import Traffic, all_reduce_bytes

if TYPE_CHECKING:
    from shoal.ft.engine import Replica

_WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def averages_in_hook(strategy: str, compression: str, group_size: int) -> bool:
    """Whether a live group's gradients cross the groups inside DDP's hook (else after
    backward)."""
    return strategy == "ddp" and compression in _WIRE and group_size == 1


class AcrossGroups:
    """State and hook: ``model.register_comm_hook(state, AcrossGroups.hook)``. The live
    session gives it ``replica`` when it opens; before (no session: nothing to cross),
    buckets stay as they are, as DDP over one process leaves them."""

    def __init__(self, traffic: Traffic, compression: str = "none", fp32: bool = True):
        self.traffic = traffic
        self.wire = _WIRE[compression]
        self.fp32 = fp32  # every gradient in float32 (so is every bucket)
        self.replica: Replica | None = None
        self._carried: torch.Tensor | None = None  # numbers that go with bucket 0
        self.settled = False
        """This process's DDP has been through a backward (its buckets are cut for good)."""
        self.settle_due = False
        """A replacement whose source had settled: settle before the first step."""
        self.muted = False  # the settling backward: buckets stay as they are

    def carry(self, numbers: torch.Tensor) -> bool:
        """Have ``numbers`` (float32) summed over the groups with the first bucket of the
        coming backward, where the gradients go in float32: one collective a step, as DDP
        makes. With 2 groups the gradients' sums stay DDP's (a sum of two is the same in any
        order); with 3 and more the longer bucket moves the borders of gloo's chunks, and
        with them the order in which some gradients are summed. False (fp16, bf16):
        ``numbers`` need a collective of their own."""
        if self.replica is None or self.wire is not None or not self.fp32:
            return False
        self._carried = numbers
        return True

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP checks them literally
        state.settled = True
        carried = None
        if bucket.index() == 0:
            carried, state._carried = state._carried, None
        return state.reduce(bucket.buffer(), carried)

    def reduce(self, buffer: torch.Tensor, carried: torch.Tensor | None = None
               ) -> torch.futures.Future[torch.Tensor]:
        """The mean of ``buffer`` over the step's groups, in place (the future's value);
        the sum of ``carried`` (see ``carry``), in place, with it."""
        if self.replica is None or self.muted:
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(buffer)
            return future
        groups = self.replica.participants
        if self.wire is None:
            sent = buffer.mul_(1.0 / groups)  # DDP's reducer: times 1/R, not divided by R
        else:
            sent = buffer.to(self.wire).div_(groups)  # torch's fp16/bf16 hooks
        if carried is not None:
            sent = torch.cat([sent, carried.to(sent.device)])
        self.traffic.sent(all_reduce_bytes(sent.numel() * sent.element_size(), groups))
        self.traffic.launched()

        def done(summed: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self.traffic.done()
            if sent is not buffer:
                buffer.copy_(summed.value()[:buffer.numel()])
            if carried is not None:
                carried.copy_(summed.value()[buffer.numel():])
            return buffer

        return self.replica.start_sum(sent).then(done)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def apply_across_groups(model: DistributedDataParallel, traffic: Traffic,
                        compression: str = "none") -> AcrossGroups:
    """Register the hook on ``model`` (a live group's DDP over its one process)."""
    fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    state = AcrossGroups(traffic, compression, fp32)
    model.register_comm_hook(state, AcrossGroups.hook)
    return state
