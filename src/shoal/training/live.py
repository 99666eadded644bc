"""A Trainer in a live job (``fault_tolerance.mode: live``): each step's meeting with the
other replica groups, what a replacement group heals from, and the random seeds of each step.

A replacement loads a live group's model, optimizer, scheduler, gradient scaler, counters
and data position. Random numbers are not copied: in a live job every step draws from
seeds of its own (run seed, step, data-parallel rank over all groups), so a replacement
draws what the lost group would have drawn, and a step done again draws the same numbers.

Under powersgd and topk each rank keeps an error feedback of its own: under 'exact' the
groups hand it over every few steps, and a replacement redoes the steps since (see
``shoal.ft.session``).

Under local_sgd and diloco the groups train apart between meetings (every ``period``
steps), and a meeting is held at the start of the step after the period's last. Under
'exact' a replacement loads the state of the last meeting with its own group's optimizer
state (each meeting gives every group the others'), and redoes the steps since.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from shoal.data.sharding import position_after
from shoal.errors import UsageError
from shoal.ft import ReplicaPlace
from shoal.ft.across import AcrossGroups
from shoal.ft.session import LiveSession, Redo
from shoal.parallel.zero import is_zero, load_local_optimizer_state, local_optimizer_state
from shoal.training.batches import loss_of
from shoal.training.checkpointing import (
    load_model_and_optimizer_state,
    model_and_optimizer_state,
)
from shoal.training.epoch_loss import EpochLoss
from shoal.training.harness import seed_everything

Trainer = Any  # a shoal.Trainer (not imported: its module imports this one)


def open_live(trainer: Trainer) -> LiveSession | None:
    """This trainer's live session, when the launcher made replica groups; else None."""
    c = trainer.config
    place = ReplicaPlace.from_environ()
    if place is None:
        if c.fault_tolerance.live:
            raise UsageError("fault_tolerance.mode 'live' needs shoal's launcher, which "
                             "starts the replica groups and the lighthouse: run under "
                             "`shoal run --replica-groups N` or `shoal train`")
        return None
    overruled = place.config.overruled(c.fault_tolerance)
    if overruled and trainer.harness.is_main and place.group == 0:
        print(f"shoal: {overruled}", file=sys.stderr, flush=True)
    place = replace(place, config=place.config.with_workers_own(c.fault_tolerance))
    if c.parallel.pp > 1:
        raise UsageError("live recovery does not support pipeline parallelism yet: use "
                         "fault_tolerance.mode 'restart'")
    h = trainer.harness
    h.replica_groups = (place.groups, place.group)
    def record(step: int, **fields: Any) -> None:  # a change of who takes part, in metrics
        if trainer._metrics is not None:
            trainer._metrics.record("event", step, **fields)

    periodic = _periodic(trainer)
    feedback = c.compression.name in ("powersgd", "topk")  # a residual per rank (ddp)
    session = LiveSession(
        place, h.rank, h.world_size, state=lambda: live_state(trainer),
        load=lambda state: load_live_state(trainer, state), record=record,
        wire=_WIRE.get(c.compression.name), periodic=periodic,
        private=(lambda: private_state(trainer)) if periodic or feedback else None,
        restore=(lambda kept: h.comm.load_state_dict(kept["comm"])) if feedback else None,
        blank=lambda: [torch.zeros_like(g) for g in gradients(trainer.model, fill=False)])
    if periodic:
        h.comm.across = session.meet
    if isinstance(h.comm, AcrossGroups):  # the gradients cross the groups in DDP's hook
        h.comm.replica = session.replica
    session.step_now = lambda: trainer.global_step
    return session


# Compressions that apply across groups too: stateless, the same rounding on every rank.
_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def live_state(t: Trainer) -> dict[str, Any]:
    """Everything a replacement needs to continue exactly as a live group will.

    Rank r of a group heals from rank r of a live group (torchft's manager pairs them),
    and the groups have the same layout, so each rank sends only what it holds itself (its
    shards under zero2 and fsdp): no collective inside the group, whose other ranks may be
    receiving at the same time (at the start every rank syncs from a group of its own)."""
    if is_zero(t.optimizer):  # the whole optimizer state would be gathered: this share
        model = get_model_state_dict(t.state_model)
        optimizer = local_optimizer_state(t.optimizer)
    else:
        model, optimizer = model_and_optimizer_state(t.state_model, t.optimizer)
    return {"model": model, "optimizer": optimizer,
            "scaler": t.harness.precision.state_dict(),
            "lr_scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler else None,
            "global_step": t.global_step, "epoch": t.epoch, "position": t.step_position,
            "accumulate": t.accumulate, "skipped_steps": list(t.skipped_steps),
            "epoch_loss": t.epoch_loss.state(),
            # DDP's buckets: cut for good here, or about to be (a replacement cuts its own
            # alike, see settle)
            "settled": isinstance(t.harness.comm, AcrossGroups) and (
                t.harness.comm.settled or t.harness.comm.settle_due),
            **({"comm": t.harness.comm.state_dict()} if _periodic(t) else {})}


def _periodic(t: Trainer) -> bool:
    return t.config.strategy in ("local_sgd", "diloco")


def private_state(t: Trainer) -> dict[str, Any]:
    """What differs between this rank and the same rank of the other groups, which
    ``live_state`` does not hold: under local_sgd and diloco after a meeting, the inner
    optimizer, loss scale and skipped steps; under powersgd and topk, the compression state
    (its error feedback)."""
    if not _periodic(t):
        return {"comm": t.harness.comm.state_dict()}
    _, optimizer = model_and_optimizer_state(t.state_model, t.optimizer)
    return {"optimizer": optimizer, "scaler": t.harness.precision.state_dict(),
            "skipped_steps": list(t.skipped_steps)}


def load_live_state(t: Trainer, state: dict[str, Any]) -> None:
    if is_zero(t.optimizer):
        set_model_state_dict(t.state_model, state["model"])
        load_local_optimizer_state(t.optimizer, state["optimizer"])
    else:
        load_model_and_optimizer_state(t.state_model, t.optimizer, state["model"],
                                       state["optimizer"])
    t.harness.precision.load_state_dict(state["scaler"])
    if t.lr_scheduler is not None:
        t.lr_scheduler.load_state_dict(state["lr_scheduler"])
    t.global_step, t.epoch, t.step_position = (state["global_step"], state["epoch"],
                                               state["position"])
    t.accumulate = state["accumulate"]
    t.epoch_loss = EpochLoss.taken_over(t.harness.device, state["epoch_loss"])
    t.skipped_steps = list(state["skipped_steps"])
    if "comm" in state:
        t.harness.comm.load_state_dict(state["comm"])
    if isinstance(t.harness.comm, AcrossGroups):
        t.harness.comm.settle_due = state["settled"] and not t.harness.comm.settled


def check_loader(loader: DataLoader) -> None:
    if position_after(loader, 0) is None:
        raise UsageError("live recovery starts a step again from its first sample, "
                         "which needs a map-style Dataset (or a DataLoader with a plain "
                         "sampler) that shoal splits itself")


def begin_step(t: Trainer, loader: DataLoader, batch: int) -> None:
    """Before the first micro-batch of a step (the loader's ``batch``): meet the other
    groups (a replacement heals here, and raises Redo), and seed the step."""
    t.step_position = position_after(loader, batch)
    live, comm = t.live, t.harness.comm
    if live.periodic:  # local_sgd, diloco: a meeting when one is due
        healed = live.join(comm.contribution)  # (computed only to join)
        if comm.due or healed:
            t.harness.synchronize()
        if healed or live.redo:  # 'available': now at a live group's step
            live.redo = False
            raise Redo()
        if live.round_due:
            live.keep_round(copy.deepcopy(live_state(t)))
    else:
        live.begin_step()
    seed_step(t)


def before_backward(t: Trainer, loss: torch.Tensor) -> None:
    """Before the step's last backward: where the gradients cross the groups in backward
    (``shoal.ft.across``), the step's loss sums start across the groups now, as backward
    computes."""
    if isinstance(t.harness.comm, AcrossGroups):
        t.live.send_numbers(t.epoch_loss.step_sum(coming=loss), t.harness.comm)


def end_step(t: Trainer, window_samples: int | None) -> None:
    """After backward: average the gradients over the groups; raises Redo when the step
    does not commit (nothing of it is applied). (local_sgd, diloco: the step's samples
    are counted, for what a missing group skips.)"""
    if t.live.periodic:
        t.live.round_samples += (window_samples or 0) // t.harness.replica_groups[0]
        return
    averaged = isinstance(t.harness.comm, AcrossGroups)  # in backward already
    if not t.live.end_step([] if averaged else gradients(t.model),
                           (window_samples or 0) // t.harness.replica_groups[0],
                           t.global_step, t.epoch_loss.step_sum()):
        t.optimizer.zero_grad(set_to_none=True)
        raise Redo()
    t.epoch_loss.take_step(*t.live.step_losses)  # every group's, as DDP over them sums


def settle(t: Trainer, batch: Any) -> None:
    """Before a replacement's first step, when due: cut DDP's buckets as the live groups
    have (``shoal.ft.across``), with one forward and backward of ``batch`` (the step's first
    micro-batch) that crosses no group. Its gradients, the module's buffers (BatchNorm's
    statistics) and the step's random numbers are put back as they were."""
    comm = t.harness.comm
    if not (isinstance(comm, AcrossGroups) and comm.settle_due):
        return
    model = t.model
    buffers = [b.clone() for b in model.buffers()]
    comm.muted = True
    try:
        with t.harness.autocast():
            loss = loss_of(model, batch, t.loss_fn, t.step_fn)
        t.harness.precision.backward(loss)
    finally:
        comm.muted = False
    comm.settle_due = False
    t.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, kept in zip(model.buffers(), buffers, strict=True):
            buffer.copy_(kept)
    seed_step(t)


def seed_step(t: Trainer) -> None:
    """Seed this rank's random numbers for the next step."""
    h = t.harness
    seed_everything((t.config.seed * 1_000_003 + t.global_step) * 65_537 + h.data_rank)


def gradients(model: torch.nn.Module, fill: bool = True) -> list[torch.Tensor]:
    """This rank's gradients (its shards under FSDP), zeros where a parameter has none, so
    that every group sends the same tensors (``fill=False``: the parameters, where none has
    a gradient yet, for their shapes)."""
    grads = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            if not fill:
                grads.append(p.to_local() if isinstance(p, DTensor) else p)
                continue
            p.grad = torch.zeros_like(p)
        g = p.grad
        grads.append(g.to_local() if isinstance(g, DTensor) else g)
    return grads
