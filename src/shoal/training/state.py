"""`TrainState`: everything a training step changes, in one object with one ``state_dict`` /
``load_state_dict``, which checkpoints save and resume and a replacement replica group heals
from (a live group's state).

It holds the model, optimizer, LR scheduler and gradient scaler (the Trainer's, by
reference), the compression's or weight averaging's state, and owns the counters: the step,
the epoch, the data position, the accumulation, the skipped steps and the epoch's running
loss. Model and optimizer state are keyed by parameter name (``torch.distributed.checkpoint.
state_dict``), the same under every strategy.

The two uses differ in what each rank sends, not in what the state is:

- a checkpoint (``heal=False``) holds the optimizer state whole (gathered under zero2), the
  epoch's loss summed over the ranks (a collective: a resume may have other ranks), and this
  rank's random streams;
- a heal (``heal=True``) is rank r of a live group to rank r of a replacement, whose groups
  have the same layout: each rank sends what it holds (its optimizer shard, its loss sums)
  and no collective runs, since the group's other ranks may be receiving at the same time.
  No random streams travel: in a live job every step seeds its own (see ``training.live``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from shoal.checkpoint import rng
from shoal.errors import UsageError
from shoal.ft.across import AcrossGroups
from shoal.ft.step import Kept
from shoal.parallel.zero import (
    gather_optimizer_state,
    is_zero,
    load_local_optimizer_state,
    load_optimizer_state,
    local_optimizer_state,
)
from shoal.training.epoch_loss import Carried, EpochLoss, per_step
from shoal.training.harness import Harness

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from shoal.training.callbacks import Callbacks


class TrainState:
    """What a step changes: the Trainer's model, optimizer, scheduler and harness (scaler,
    compression), and the counters below."""

    def __init__(self, harness: Harness, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, accumulate: int):
        """``model``: what model state is read from and loaded into (a wrapper, or a
        pipeline stage)."""
        self.harness, self.model = harness, model
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.global_step = 0
        """Optimizer steps taken (skipped ones included)."""
        self.epoch = 0
        self.position: int | None = 0
        """Global samples of the epoch that the steps taken consumed: where the next step
        begins (None: the loader cannot say, and the epoch starts over on resume)."""
        self.accumulate = accumulate
        """Micro-batches a step (a resume on other ranks may change it)."""
        self.skipped_steps: list[int] = []
        """Steps skipped for non-finite gradients."""
        self.callbacks: Callbacks | None = None
        """The Trainer's callbacks, whose states travel with the run's (checkpoints,
        heals)."""
        self.epoch_loss = EpochLoss(harness.device)
        """The epoch's running loss sums, since it began."""
        self.unwritten: list[tuple] = []
        """A live job's: this rank's figures of the steps whose window the group that
        writes the metrics may not have written yet (``shoal.metrics.unwritten``), which
        the next group to write them writes. A heal's, not a checkpoint's."""

    @property
    def periodic(self) -> bool:
        """The groups' replicas meet only every few steps (local_sgd, diloco)."""
        return self.harness.config.strategy in ("local_sgd", "diloco")

    def step_taken(self, position: int | None) -> None:
        """After an optimizer step: the data position is now ``position``."""
        self.global_step += 1
        self.position = position

    def next_epoch(self) -> None:
        self.epoch += 1
        self.restart_epoch()

    def restart_epoch(self) -> None:
        """Back to the epoch's start: its position and its loss sums."""
        self.position = 0
        self.epoch_loss = EpochLoss(self.harness.device)

    def state_dict(self, *, heal: bool = False) -> dict[str, Any]:
        """Everything a step changes: for a checkpoint, or (``heal``) for the same rank of
        a replacement group (see the module's docstring). Collective unless ``heal``."""
        h = self.harness
        if heal and is_zero(self.optimizer):  # the whole would be gathered: this share
            model = get_model_state_dict(self.model)
            optimizer = local_optimizer_state(cast("ZeroRedundancyOptimizer", self.optimizer))
        else:
            model, optimizer = model_and_optimizer_state(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer, "scaler": h.precision.state_dict(),
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler
                 else None,
                 "global_step": self.global_step, "epoch": self.epoch, "position": self.position,
                 "accumulate": self.accumulate, "skipped_steps": list(self.skipped_steps),
                 "callbacks": self.callbacks.state_dict() if self.callbacks else None}
        if not heal:
            groups = h.replica_groups[0]
            return {**state, "comm": h.comm_state_dict(), "rng": rng.capture(),
                    # every rank's sums so far: a resumed epoch reports the whole epoch
                    "epoch_loss": [*self.epoch_loss.totals(h.world_size),
                                   per_step(h.world_size, groups, self.accumulate)]}
        state["epoch_loss"] = self.epoch_loss.state()
        state["unwritten"] = Kept(self.unwritten)  # (a hand-over's copy keeps it as is)
        if self.periodic:  # the replica's outer state (the groups' is the same)
            state["comm"] = h.comm.state_dict()
        # DDP's buckets: cut for good here, or about to be (a replacement cuts its own
        # alike, see training.settling)
        state["settled"] = isinstance(h.comm, AcrossGroups) and (h.comm.settled
                                                                  or h.comm.settle_due)
        return state

    def load_state_dict(self, state: dict[str, Any], *, heal: bool = False) -> None:
        """Load what ``state_dict`` gave (with the same ``heal``). A checkpoint's state may
        lack ``comm`` or ``rng`` (they do not apply here: see ``Checkpointing.resume``),
        and its ``accumulate`` is the one to continue with."""
        h = self.harness
        if heal and is_zero(self.optimizer):
            set_model_state_dict(self.model, state["model"])
            load_local_optimizer_state(cast("ZeroRedundancyOptimizer", self.optimizer),
                                       state["optimizer"])
        else:
            load_model_and_optimizer_state(self.model, self.optimizer, state["model"],
                                           state["optimizer"])
        h.precision.load_state_dict(state["scaler"])
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.position, self.accumulate = state["position"], state["accumulate"]
        self.skipped_steps = list(state.get("skipped_steps", []))
        if self.callbacks and state.get("callbacks") is not None:
            self.callbacks.load_state_dict(state["callbacks"])
        if heal:
            self.epoch_loss = EpochLoss.taken_over(h.device, state["epoch_loss"])
            self.unwritten = list(state["unwritten"])
            if "comm" in state:
                h.comm.load_state_dict(state["comm"])
            if isinstance(h.comm, AcrossGroups):
                h.comm.settle_due = state["settled"] and not h.comm.settled
            return
        # The epoch's sums so far count once, on rank 0, and only mid-epoch.
        carried = state.get("epoch_loss")
        self.epoch_loss = EpochLoss(
            h.device, Carried(*carried) if carried and self.position and h.rank == 0
            else None, per_step=per_step(h.world_size, h.replica_groups[0], self.accumulate))
        if "comm" in state:
            h.load_comm_state_dict(state["comm"]["state"])
        if "rng" in state:
            rng.restore(state["rng"])

    def private_state(self) -> dict[str, Any]:
        """What differs between this rank and the same rank of the other groups, which the
        heal state does not hold: under local_sgd and diloco after a meeting, the inner
        optimizer, loss scale, skipped steps and the epoch's loss sums (each group's cover
        its own losses: the groups do not sum theirs between meetings); under powersgd and
        topk, the compression state (its error feedback)."""
        if not self.periodic:
            return {"comm": self.harness.comm.state_dict()}
        _, optimizer = model_and_optimizer_state(self.model, self.optimizer)
        return {"optimizer": optimizer, "scaler": self.harness.precision.state_dict(),
                "skipped_steps": list(self.skipped_steps),
                "epoch_loss": self.epoch_loss.state()}

    def load_private_state(self, state: dict[str, Any]) -> None:
        """Back to a ``private_state`` of a ddp compression (a step that did not commit is
        undone in the error feedback too)."""
        self.harness.comm.load_state_dict(state["comm"])

    def blank_gradients(self) -> list[torch.Tensor]:
        """Zeros shaped like this rank's gradients (what a group sitting a step out sends)."""
        return [torch.zeros_like(g) for g in gradients(self.model, fill=False)]


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


@contextlib.contextmanager
def unhooked(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """torch's state-dict functions create a fresh optimizer's state by a step with zero
    gradients and learning rate; the user's step hooks must not count it as a step."""
    hooks = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = hooks


def model_and_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                              ) -> tuple[dict, dict]:
    """Model and optimizer state keyed by parameter name, the same form under every
    strategy; sharded tensors stay DTensors (DCP writes each shard once)."""
    if is_zero(optimizer):
        return get_model_state_dict(model), gather_optimizer_state(
            model, cast("ZeroRedundancyOptimizer", optimizer))
    fresh = not optimizer.state
    with unhooked(optimizer):
        model_state, optimizer_state = get_state_dict(model, optimizer)
    if fresh:  # no step yet: save it as it is (Adam's step count must stay 0)
        optimizer.state.clear()
        optimizer_state["state"] = {}
    return model_state, optimizer_state


def load_model_and_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                   model_state: dict, optimizer_state: dict) -> None:
    """Load what ``model_and_optimizer_state`` gave, from any strategy, into this one."""
    if is_zero(optimizer):
        set_model_state_dict(model, model_state)
        load_optimizer_state(model, cast("ZeroRedundancyOptimizer", optimizer), optimizer_state)
    elif any(isinstance(p, int) for group in optimizer_state["param_groups"]
             for p in group["params"]):
        # Written before checkpoints were keyed by name: the optimizer's own numbering.
        set_model_state_dict(model, model_state)
        optimizer.load_state_dict(optimizer_state)
    else:
        with unhooked(optimizer):
            set_state_dict(model, optimizer, model_state_dict=model_state,
                           optim_state_dict=optimizer_state)


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor],
                       source: str) -> None:
    """Full tensors by name (``trainer.init_from``) into ``model`` under any strategy: each
    rank takes its shard; a pipeline stage, its own names.

    Raises:
        UsageError: If ``weights`` lacks some of the model's names, or differs in a shape;
            the message names them.
    """
    own = cast("dict[str, torch.Tensor]", get_model_state_dict(model))
    missing = [k for k in own if k not in weights]
    if missing:
        raise UsageError(f"init_from {source}: no weights for {', '.join(missing[:5])}"
                         f"{' and more' if len(missing) > 5 else ''} (it has "
                         f"{', '.join(list(weights)[:5])}{', ...' if len(weights) > 5 else ''})")
    wrong = [k for k in own if tuple(weights[k].shape) != tuple(own[k].shape)]
    if wrong:
        k = wrong[0]
        raise UsageError(f"init_from {source}: {k} has shape {tuple(weights[k].shape)}, the "
                         f"model's is {tuple(own[k].shape)}")
    set_model_state_dict(model, {k: weights[k] for k in own},
                         options=StateDictOptions(full_state_dict=True))
