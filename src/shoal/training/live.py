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

import sys
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from shoal.data.sharding import position_after
from shoal.errors import UsageError
from shoal.ft import ReplicaPlace
from shoal.ft.across import in_hook
from shoal.ft.periodic import PeriodicSession
from shoal.ft.session import LiveSession
from shoal.ft.step import StepOutcome
from shoal.runtime.seeds import seed_everything
from shoal.training.state import gradients

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
    own = trainer.state.periodic or c.compression.name in ("powersgd", "topk")
    if own and place.config.policy == "exact" and c.checkpoint_every_seconds and \
            h.is_main and place.group == 0:
        # (each group keeps its own part of a step's checkpoint at checkpoint_every's
        # steps, which every group knows; a timed one's step only the writing group does)
        part = "replica" if trainer.state.periodic else "error feedback"
        print("shoal: policy exact: a checkpoint taken by checkpoint_every_seconds holds "
              f"only the writing group's own {part}: every group lost at once resumes from "
              "the last checkpoint_every step instead, which holds every group's (without "
              "one, from the timed one: not bitwise the run without failures)",
              file=sys.stderr, flush=True)

    def record(step: int, **fields: Any) -> None:  # a change of who takes part, in metrics
        trainer.recording.record("event", step, **fields)

    if trainer.state.periodic:
        periodic = PeriodicSession(place, h.rank, h.world_size, trainer.state, record=record,
                                   least=lambda values: _least(h.device, values))
        h.comm.across = periodic.meet
        return periodic
    session = LiveSession(place, h.rank, h.world_size, trainer.state, record=record,
                          wire=_WIRE.get(c.compression.name),
                          # a residual per rank (ddp)
                          feedback=c.compression.name in ("powersgd", "topk"),
                          least=lambda values: _least(h.device, values))
    if in_hook(h.comm):  # the gradients cross the groups in DDP's hook
        session.attach(h.comm)
    return session


def _least(device: torch.device, values: list[int]) -> list[int]:
    """The least of each of ``values`` over this group's processes (one all-reduce on its
    default process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    least = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return least.tolist()


# Compressions that apply across groups too: stateless, the same rounding on every rank.
_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_loader(loader: DataLoader) -> None:
    if position_after(loader, 0) is None:
        raise UsageError("live recovery starts a step again from its first sample, "
                         "which needs a map-style Dataset (or a DataLoader with a plain "
                         "sampler) that shoal splits itself")


def begin_step(t: Trainer) -> StepOutcome:
    """Before the first micro-batch of a step: meet the other groups, and seed the step.
    HEALED: this group now holds a live group's state (training goes on from its step and
    data position); else GO."""
    live, comm = t.live, t.harness.comm
    if live.periodic:  # local_sgd, diloco: a meeting when one is due
        outcome = live.join(comm.contribution)  # (computed only to join)
        if outcome is not StepOutcome.HEALED:  # ('exact': redo the steps since the meeting)
            if comm.due or live.joins_meeting:
                t.harness.synchronize()
            outcome = live.after_meeting()
    else:  # the step's losses go with its average (a step done again drops them)
        outcome = live.begin_step()
        t.state.epoch_loss.mark()  # (after the quorum: a heal there brings sums of its own)
    if t.recording.unwritten is not None:  # the step metrics are on
        _metrics_writer(t, healed=outcome is StepOutcome.HEALED)
    if outcome is StepOutcome.GO:
        seed_step(t)
    return outcome


def _metrics_writer(t: Trainer, healed: bool) -> None:
    """After a quorum: the step metrics are written by the first group in it, as the
    checkpoints are (group 0 where it takes part, ``LiveSession.saves``). A group that
    becomes the writer (a replacement of group 0, or the next group while group 0 is
    missing under 'available'), and the writer after a heal, writes the steps it holds
    (``shoal.metrics.unwritten``) that the file does not, and marks its start at the step
    before the first (the dashboard forgets what was written after it: done again). A
    group that stops writing drops its window: the new writer has those steps."""
    live, state, recording = t.live, t.state, t.recording
    metrics = recording.metrics
    if not live.saves:
        if metrics is not None:
            recording.close_metrics()
        return
    if metrics is None:
        metrics = recording.open_metrics()
    elif not healed and metrics.announced:
        return
    before = metrics.adopt(state.unwritten)
    metrics.started(state.global_step if before is None else before)


def before_backward(t: Trainer, loss: torch.Tensor) -> None:
    """Before the step's last backward: where the gradients cross the groups in backward
    (``shoal.ft.across``), the step's loss sums start across the groups now, as backward
    computes."""
    if in_hook(t.harness.comm):
        t.live.send_numbers(t.state.epoch_loss.step_sum(coming=loss))


def end_step(t: Trainer, window_samples: int | None) -> StepOutcome:
    """After backward: average the gradients over the groups. COMMITTED, or AGAIN: the
    step did not commit, and nothing of it is applied (its gradients and losses are taken
    back). (local_sgd, diloco: the step's samples are counted, for what a missing group
    skips.)"""
    live, state = t.live, t.state
    samples = (window_samples or 0) // t.harness.replica_groups[0]
    if live.periodic:
        live.count_samples(samples)
        return StepOutcome.COMMITTED
    averaged = in_hook(t.harness.comm)  # in backward already, with the step's losses
    grads = gradients(t.model) if live.needs_gradients or not averaged else []
    losses = (0.0, 0) if averaged else state.epoch_loss.step_sum()
    outcome = live.end_step(grads, samples, state.global_step, losses, averaged=averaged)
    if outcome is StepOutcome.AGAIN:
        t.optimizer.zero_grad(set_to_none=True)
        state.epoch_loss.rewind()
    else:
        state.epoch_loss.take_step(*live.step_losses)  # every group's, as DDP over them sums
    return outcome


def step_figures(t: Trainer, loss: torch.Tensor, samples: int, tokens: int,
                 micro_batches: int) -> tuple[torch.Tensor, int, int]:
    """A committed step's figures for the metrics (this rank's mean loss over its
    ``micro_batches``, samples, tokens), as DDP over the ranks of every group reports
    them: the mean loss of the same rank of every group in the step (their sums travel
    with its average, ``LiveSession.step_losses``), and the samples and tokens of them all
    (each group's step holds as many). With one micro-batch a step that mean is DDP's
    bitwise; with more, DDP's mean of the ranks' means may differ in its last bits. The
    periodic strategies' groups do not meet each step: this group's own."""
    if t.live.periodic:
        return loss, samples, tokens
    total, batches = t.live.step_losses
    groups = batches // micro_batches
    return (torch.tensor(total / batches, dtype=torch.float64, device=loss.device),
            samples * groups, tokens * groups)


def seed_step(t: Trainer) -> None:
    """Seed this rank's random numbers for the next step."""
    h = t.harness
    seed_everything((t.config.seed * 1_000_003 + t.state.global_step) * 65_537
                    + h.data_rank)
