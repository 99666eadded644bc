"""DDP's buckets cut as the run a process continues had cut them.

DDP's first backward in a process reduces the gradients in the buckets it starts with, and
the next forward cuts them anew, in the order the gradients became ready. The sums of a
bucket over more than two ranks depend on where each gradient lies in it (gloo's ring sums
each chunk from another rank on), so a process that continues a run past its first step (a
resume from a checkpoint, a live replacement) must cut its buckets as the run did before
its first step, or its sums differ in the last bits from the run it continues. It settles
them with one forward and backward of the step's first micro-batch that changes nothing:
its gradients, the module's buffers (BatchNorm's statistics), the random streams, the
compression's state (error feedback) and the step's traffic are put back as they were. (A
sum of two is the same in any order: a DDP group of two ranks is not settled, unless its
next backward is powersgd's first compressed step, whose random Qs are drawn in the order
of the bucket's parameters: ``PowerSGDHook.draws_due``. A forward of
the user's that records what it sees can tell the settling pass by ``settling()``.)
Across live groups (``shoal.ft.across``) the settling backward crosses no group (under
topk none is needed: its selections follow the parameters' order); elsewhere every rank of
the process group settles at the same step, and its sums are thrown away.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shoal.checkpoint import rng
from shoal.ft.across import AcrossGroups, TopKAcrossGroups
from shoal.ft.step import copied
from shoal.parallel.powersgd import PowerSGDHook
from shoal.training.batches import loss_of

Trainer = Any  # a shoal.Trainer (not imported: its module imports this one)


def settle_after_resume(t: Trainer) -> None:
    """The run continues past its first step in this process: settle before the step."""
    comm = t.harness.comm
    if isinstance(comm, AcrossGroups):
        comm.settle_due = not comm.settled
    elif not isinstance(comm, TopKAcrossGroups):  # (its selections follow the parameters)
        model = t.model
        # (a sum of two is the same in any order: two ranks need no settling)
        t.harness.settle_due = isinstance(model, DistributedDataParallel) and \
            dist.get_world_size(model.process_group) > 2


_settling = False


def settling() -> bool:
    """Whether this process now settles DDP's buckets: the forward under way is not a
    step's (its gradients are thrown away). A forward that records what it trains on can
    skip it."""
    return _settling


def settle(t: Trainer, batch: Any) -> None:
    """Before a step's first micro-batch ``batch``, where due: cut DDP's buckets for good
    (see the module's docstring)."""
    h, model = t.harness, t.model
    comm = h.comm
    across = isinstance(comm, AcrossGroups)
    # (under powersgd also a process whose first backward draws the random Qs, whatever
    # its ranks: they are drawn in the order of a bucket's parameters)
    if not (comm.settle_due if across
            else h.settle_due or (isinstance(comm, PowerSGDHook) and comm.draws_due)):
        return
    buffers = [b.clone() for b in model.buffers()]
    streams = rng.capture()
    kept = None if across else copied(comm.state_dict())
    global _settling
    if across:
        comm.muted = True
    _settling = True
    try:
        with h.autocast():
            loss = loss_of(model, batch, t.loss_fn, t.step_fn)
        h.precision.backward(loss)
    finally:
        _settling = False
        if across:
            comm.muted = False
    comm.settle_due = h.settle_due = False
    t.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    if kept is not None:
        comm.load_state_dict(kept)
    h.traffic.end_step(step=False)  # what the settling backward sent is no step's
    rng.restore(streams)
