"""The average across replica groups inside DDP's own reduction (live mode, groups of one
process each, strategy ddp, compression none, fp16, bf16 or topk).

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

Under topk each group selects from its whole gradient (with its own error feedback), and
the groups gather their selections as the ranks of one process group do
(``TopKAcrossGroups``), with the step's numbers at the end of each group's message; a
selection follows the model's parameter order, not the buckets', so a replacement needs no
settling.

A sum or gather that fails (a group lost during the step) never raises inside backward: the
step is marked as errored and does not commit (``shoal.ft.session``). Groups of several
processes, powersgd, and the other strategies average after backward instead.

Every group must cut its buckets alike. DDP's first backward in a process sends the whole
model as one bucket, and the next forward cuts the buckets anew, in the order its gradients
became ready. A replacement that heals from a group past its first backward therefore
settles its buckets first: one forward and backward of the step's first micro-batch that
crosses no group and changes nothing (``settle_due``, see ``shoal.training.live``).
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from shoal.parallel.comm import Comm
from shoal.parallel.compression import CompressionConfig
from shoal.parallel.topk import TopKHook
from shoal.parallel.traffic import Traffic, all_gather_bytes, all_reduce_bytes

if TYPE_CHECKING:
    from shoal.ft.engine import Replica

_WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def averages_in_hook(strategy: str, compression: str, group_size: int) -> bool:
    """Whether a live group's gradients cross the groups inside DDP's hook (else after
    backward)."""
    return strategy == "ddp" and (compression in _WIRE or compression == "topk") \
        and group_size == 1


def in_hook(comm: object) -> bool:
    """Whether ``comm`` (a harness's) sends the gradients across the groups in backward."""
    return isinstance(comm, (AcrossGroups, TopKAcrossGroups))


class Carried:
    """A step's numbers (float32) on their way across the groups with its gradients
    (``carry``): summed in place (an all-reduce), or every group's row (a gather, ``rows``);
    ``sums`` reads them once backward is done. Each slot's sum is exact (see
    ``LiveSession._numbers``), so it is the same in any order and precision."""

    def __init__(self, numbers: list[float]):
        # (from an array's buffer: about half the time of torch.tensor from a list)
        self.sent = torch.frombuffer(array.array("f", numbers), dtype=torch.float32)
        """What this group sends (an all-reduce sums it in place)."""
        self.rows: torch.Tensor | None = None
        """(groups, numbers): every group's, where they were gathered."""

    def sums(self) -> list[float]:
        if self.rows is None:
            return self.sent.tolist()
        return self.rows.sum(0).tolist()  # (exact in float32: see the class's docstring)


class AcrossGroups(Comm):
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

    def carry(self, numbers: list[float]) -> Carried | None:
        """Have ``numbers`` summed over the groups with the first bucket of the coming
        backward, where the gradients go in float32: one collective a step, as DDP makes.
        With 2 groups the gradients' sums stay DDP's (a sum of two is the same in any
        order); with 3 and more the longer bucket moves the borders of gloo's chunks, and
        with them the order in which some gradients are summed. None (fp16, bf16):
        ``numbers`` need a collective of their own."""
        if self.replica is None or self.wire is not None or not self.fp32:
            return None
        carried = Carried(numbers)
        self._carried = carried.sent  # summed in place
        return carried

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

        def done(summed: torch.Tensor) -> torch.Tensor:
            self.traffic.done()
            if carried is not None:
                carried.copy_(summed[buffer.numel():])
            if sent is buffer:
                return buffer
            if self.wire is None:  # DDP copies the bucket's gradients out of the sum itself
                return summed[:buffer.numel()]
            return buffer.copy_(summed[:buffer.numel()])

        return self.replica.start_sum(sent, then=done)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class TopKAcrossGroups(TopKHook):
    """topk's hook, whose ranks are the groups of the step: each group's selection is
    gathered from every group on the quorum's process group, and their sum divided by the
    groups taking part. The live session gives it ``replica`` when it opens; before, and
    while ``muted`` (a replacement redoing steps alone), a group's selection stays its
    own."""

    def __init__(self, model: torch.nn.Module, ratio: float, traffic: Traffic):
        super().__init__(model, ratio, traffic)
        self.replica: Replica | None = None
        self.muted = False
        self._carried: Carried | None = None
        self.last: tuple[torch.Tensor, int] | None = None
        """The last step's selections of every group, as gathered, and the groups that
        took part: what its mean is made of (``sum_of_selections``), far smaller than the
        mean (None: the step crossed no group)."""

    def carry(self, numbers: list[float]) -> Carried | None:
        """Have ``numbers`` go to every group with the coming backward's gather, at the end
        of each group's message (``Carried.sums`` adds them up: each is a sum of exact
        parts, the same as an all-reduce's)."""
        if self.replica is None:
            return None
        self._carried = Carried(numbers)
        return self._carried

    def blank(self, numbers: list[float], dtype: torch.dtype) -> Carried:
        """A step's gather for a group that brings nothing to it: zeros in place of a
        selection of ``dtype`` values, with ``numbers``."""
        assert self.replica is not None  # a live session's
        payload = torch.zeros(self.payload_bytes(dtype), dtype=torch.uint8)
        carried = self._carried = Carried(numbers)
        self._gather(payload)[0].wait()
        return carried

    def _gather(self, payload: torch.Tensor
                ) -> tuple[torch.futures.Future[torch.Tensor], int]:
        carried, self._carried = self._carried, None
        self.last = None
        if self.replica is None or self.muted:
            return super()._gather(payload)  # a group of one process: its own
        groups = self.replica.participants
        n = payload.numel()
        if carried is None:
            sent = payload
        else:
            numbers = carried.sent
            if numbers.device != payload.device:
                numbers = numbers.to(payload.device)
            sent = torch.cat([payload, numbers.view(torch.uint8)])
        self.traffic.sent(all_gather_bytes(sent.numel(), groups))
        self.traffic.launched()

        def rows(every: torch.Tensor) -> torch.Tensor:
            self.traffic.done()
            selections = every[:, :n]
            if carried is not None:  # summed by the step (Carried.sums), after backward
                numbers = every[:, n:]
                if n % 4:  # (float32 from a multiple of its size)
                    numbers = numbers.contiguous()
                carried.rows = numbers.view(torch.float32)
            self.last = selections, groups
            return selections

        return self.replica.start_gather(sent, then=rows), groups


def apply_across_groups(model: DistributedDataParallel, traffic: Traffic,
                        compression: CompressionConfig) -> AcrossGroups | TopKAcrossGroups:
    """Register the hook on ``model`` (a live group's DDP over its one process)."""
    if compression.name == "topk":
        topk = TopKAcrossGroups(model.module, compression.ratio, traffic)
        model.register_comm_hook(topk, TopKAcrossGroups.hook)
        return topk
    fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    state = AcrossGroups(traffic, compression.name, fp32)
    model.register_comm_hook(state, AcrossGroups.hook)
    return state
