"""Save and restore everything a Trainer needs to continue a run exactly.

A checkpoint holds model, optimizer, LR scheduler, gradient scaler, every rank's RNG
states, the step and epoch counters and the data position (global samples consumed in the
epoch). Resumed with another world size, the global batch stays the same: accumulation is
adjusted where it divides, and a clear error says what to change where it does not.

Model and optimizer state are keyed by parameter name (``torch.distributed.checkpoint.
state_dict``), the same under every strategy: sharded tensors are saved as shards and loaded
into whatever layout the resuming strategy has, so a run saved under 'fsdp' on 2 processes
continues under 'ddp' on 1, and the reverse.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from shoal.checkpoint import CheckpointError, CheckpointStore, rng, tree
from shoal.errors import UsageError
from shoal.parallel.pipeline_parallel import placed_in_stage
from shoal.parallel.zero import gather_optimizer_state, is_zero, load_optimizer_state

# layers: up to remote/, which imports nothing of training: checkpoints hold a tier's state
from shoal.remote.module import remote_modules
from shoal.training.config import TrainerConfig
from shoal.training.epoch_loss import Carried, EpochLoss, per_step
from shoal.training.harness import Harness

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


class Trainer(Protocol):
    """What checkpoints read from and restore into a ``shoal.Trainer`` (named here so that
    this module does not import the Trainer's, which imports this one)."""

    config: TrainerConfig
    harness: Harness
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    global_step: int
    epoch: int
    accumulate: int
    run_config: dict | None
    tracking: dict[str, str]
    checkpointing: Checkpointing | None
    epoch_loss: EpochLoss

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def state_model(self) -> torch.nn.Module: ...


def _say(trainer: Trainer, message: str) -> None:
    if trainer.harness.is_main:
        print(f"shoal: {message}", file=sys.stderr, flush=True)


class Checkpointing:
    """The Trainer's checkpoints: when to save, what to save, how to resume."""

    def __init__(self, trainer: Trainer, directory: str, every: int | None, keep_last: int,
                 async_save: bool = False, every_seconds: float | None = None):
        self.trainer = trainer
        self.store = CheckpointStore(directory, keep_last=keep_last, async_save=async_save)
        self.every = every
        self.every_seconds = every_seconds
        self.saved_step = -1
        self.saved_at = time.monotonic()
        self._requested = False  # a timed save was asked for and has not happened yet
        self.local = trainer.config.strategy in ("local_sgd", "diloco")
        # Collective, called by every rank first thing in a save (the step metrics' flush).
        self.before_save: Callable[[], None] | None = None

    def time_due(self) -> bool:
        """Rank 0's clock says a timed checkpoint is due (the ranks then agree on a step);
        said once, until the save happens."""
        due = (self.every_seconds is not None and self.trainer.harness.is_main
               and not self._requested
               and time.monotonic() - self.saved_at >= self.every_seconds)
        self._requested = self._requested or due
        return due

    def after_step(self, consumed: int | None) -> None:
        if self.every and self.trainer.global_step % self.every == 0:
            self.save(consumed)

    def save(self, consumed: int | None) -> Path | None:
        t = self.trainer
        if self.before_save is not None:
            self.before_save()
        if not _finite(t):
            _say(t, f"not saving step {t.global_step}: the model holds NaN or Inf; the last "
                    "good checkpoint stays the newest")
            return None
        shared = {"scaler": t.harness.precision.state_dict()}
        own = {"rng": rng.capture(), "comm": t.harness.comm_state_dict()}
        # Under local_sgd / diloco every rank holds its own replica and optimizer state.
        replicas = own if self.local else shared
        model_state, optimizer_state = model_and_optimizer_state(t.state_model, t.optimizer)
        replicas.update(model=model_state, optimizer=optimizer_state)
        if t.lr_scheduler is not None:
            shared["lr_scheduler"] = t.lr_scheduler.state_dict()
        c = t.config
        meta = {"global_step": t.global_step, "epoch": t.epoch,
                # None: the loader cannot resume mid-epoch; the epoch restarts instead.
                "consumed": consumed, "batch_size": c.batch_size,
                # Every rank's so far (a collective): a resumed epoch reports the whole.
                "epoch_loss": [*t.epoch_loss.totals(t.harness.world_size),
                               per_step(t.harness.world_size, t.harness.replica_groups[0],
                                        t.accumulate)],
                "global_batch": t.harness.data_ranks * c.batch_size * t.accumulate,
                "seed": c.seed, "trainer_config": c.model_dump(mode="json"),
                "run_config": t.run_config, "tracking": t.tracking,
                "remote": {name: m.tier_state() for name, m in remote_modules(t.module).items()}}
        path = self.store.save(t.global_step, shared, own, meta)
        self.saved_step = t.global_step
        self.saved_at = time.monotonic()
        self._requested = False
        return path

    def resume(self, source: str) -> tuple[int, Carried | None]:
        """Load the checkpoint ``source`` names ('auto': the newest complete one).

        Returns the samples of the current epoch already consumed, and the epoch's loss sum
        and batch count over every rank when it was saved (None: unknown).
        """
        t = self.trainer
        path = self.store.latest() if source == "auto" else Path(source)
        if path is None:
            _say(t, f"no checkpoint in {self.store.root}; starting from the beginning")
            return 0, None
        live = get_model_state_dict(t.state_model)
        others = _other_stages(live) if t.harness.dims.pp_enabled else None
        shared, own, meta = self.store.load(path, like=self._layout() if t.harness.split
                                            else None, skip=others)
        replicas = self._replicas(path, shared, own, meta)
        model_state, optimizer_state = replicas["model"], replicas["optimizer"]
        if t.harness.dims.pp_enabled:  # this stage's part of the whole model's state
            model_state, optimizer_state = _stage_part(model_state, optimizer_state, live)
        _check_model_fits(path, model_state, live)
        load_model_and_optimizer_state(t.state_model, t.optimizer, model_state,
                                       optimizer_state)
        live_remote = remote_modules(t.module)
        for name, state in meta.get("remote", {}).items():
            if name in live_remote:
                live_remote[name].load_tier_state(state)
        t.harness.precision.load_state_dict(shared["scaler"])
        if t.lr_scheduler is not None and "lr_scheduler" in shared:
            t.lr_scheduler.load_state_dict(shared["lr_scheduler"])
        if own is not None:
            rng.restore(own["rng"])
        if t.harness.dims.tp_enabled:
            # A rank's saved streams may come from another layout: the tp ranks of a dp
            # rank must draw the same numbers (replicated activations, dropout).
            states = [rng.capture()]
            assert t.harness.mesh is not None  # built by the setup of a tp model
            dist.broadcast_object_list(states, group=t.harness.mesh["tp"].get_group(),
                                       group_src=0)
            rng.restore(states[0])
        self._restore_comm(own, meta)
        t.global_step, t.epoch = meta["global_step"], meta["epoch"]
        t.tracking = dict(meta.get("tracking") or {})  # the MLflow run to continue
        self.saved_step = t.global_step
        self._keep_global_batch(meta)
        writes = (f"new checkpoints go to {self.store.root}" if t.checkpointing is self
                  else "no new checkpoints are written (checkpoint_dir is unset)")
        _say(t, f"resumed from {path} (step {t.global_step}, epoch {t.epoch}, "
                f"saved by {meta['world_size']} processes); {writes}")
        saved_loss = meta.get("epoch_loss")  # absent from checkpoints of earlier releases
        return meta["consumed"] or 0, Carried(*saved_loss) if saved_loss else None

    def _layout(self) -> dict[str, torch.Tensor]:
        """Empty tensors shaped like this rank's shards, for DCP to load each rank's part
        into (rather than every rank reading whole tensors), under both prefixes a
        checkpoint may file them under."""
        t = self.trainer
        with _unhooked(t.optimizer):  # a fresh optimizer's state is created, to load into
            model_state, optimizer_state = get_state_dict(t.state_model, t.optimizer)
        _, tensors = tree.split({"model": model_state, "optimizer": optimizer_state}, "shared")
        like = {k: torch.empty_like(v) for k, v in tensors.items()}
        own = f"rank{t.harness.rank}"
        return {**like, **{own + k.removeprefix("shared"): v for k, v in like.items()}}

    def _restore_comm(self, own: dict | None, meta: dict) -> None:
        """The compression's or weight averaging's state, when it can continue exactly."""
        t = self.trainer
        saved = (own or {}).get("comm") or {}
        if not saved.get("state"):
            return
        if saved["kind"] != t.harness.comm_kind:
            _say(t, f"the checkpoint's {saved['kind']} state does not apply to "
                    f"{t.harness.comm_kind}: starting it afresh")
        elif meta["world_size"] != t.harness.world_size:
            _say(t, f"world size {t.harness.world_size} differs from the checkpoint's "
                    f"{meta['world_size']}: the per-rank {saved['kind']} state (error "
                    "feedback) starts afresh")
        else:
            t.harness.load_comm_state_dict(saved["state"])

    def _replicas(self, path: Path, shared: dict, own: dict | None, meta: dict) -> dict:
        """Where model and optimizer state are: shared, or per rank (local_sgd, diloco)."""
        if "model" in shared:  # one replica: every strategy can start from it
            return shared
        strategy = self.trainer.config.strategy
        if not self.local:
            raise UsageError(f"checkpoint {path} holds one replica per process (saved under "
                             f"local_sgd or diloco); strategy '{strategy}' cannot continue "
                             "it: resume with the strategy that saved it")
        if own is None or meta["world_size"] != self.trainer.harness.world_size:
            raise UsageError(f"checkpoint {path} holds one replica per process of "
                             f"{meta['world_size']} (strategy '{strategy}'); resume it with "
                             f"{meta['world_size']} processes")
        return own

    def _keep_global_batch(self, meta: dict) -> None:
        t = self.trainer
        world, batch = t.harness.data_ranks, t.config.batch_size
        global_batch = meta["global_batch"]
        if global_batch == world * batch * t.accumulate:
            return
        if global_batch % (world * batch):
            raise UsageError(
                f"the checkpoint's global batch is {global_batch} samples, which "
                f"{world} data-parallel ranks x batch_size {batch} cannot make up; use a "
                f"batch_size that divides "
                f"{global_batch // world if global_batch % world == 0 else '?'} or a "
                f"data-parallel degree that divides {global_batch // batch}")
        t.accumulate = global_batch // (world * batch)
        _say(t, f"{world} data-parallel ranks x batch_size {batch} differ from the "
                f"checkpoint's layout ({meta['world_size']} processes): accumulating "
                f"{t.accumulate} micro-batches to keep the global batch of {global_batch}")


@contextlib.contextmanager
def _unhooked(optimizer: torch.optim.Optimizer) -> Iterator[None]:
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
    with _unhooked(optimizer):
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
        with _unhooked(optimizer):
            set_state_dict(model, optimizer, model_state_dict=model_state,
                           optim_state_dict=optimizer_state)


def _finite(t: Trainer) -> bool:
    """No NaN or Inf in the model. Replicas are identical, so every rank reaches the same
    verdict without talking; shards differ, so sharded ranks agree on one."""
    finite = all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                 for p in t.module.parameters())
    if not t.harness.split or t.harness.world_size == 1:
        return finite
    flag = torch.tensor([int(finite)], device=t.harness.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _other_stages(live: dict) -> Callable[[str], bool]:
    """Whether a checkpoint key holds another pipeline stage's parameter or its optimizer
    state (this stage's parameters are ``live``): such tensors are not read."""
    def other(key: str) -> bool:
        if key.startswith("shared.model."):
            name = key.removeprefix("shared.model.")
        elif key.startswith("shared.optimizer.state."):  # <name>.<state key>
            name = key.removeprefix("shared.optimizer.state.").rsplit(".", 1)[0]
        else:
            return False
        return name not in live and placed_in_stage(name)
    return other


def _stage_part(model_state: dict, optimizer_state: dict, live: dict) -> tuple[dict, dict]:
    """The entries of a whole model's (name-keyed) state that belong to this pipeline
    stage, whose own state has the keys ``live``. A key of neither is left to
    ``_check_model_fits`` to report: only other stages' parameters are dropped."""
    def mine(name: str) -> bool:
        return name in live or not placed_in_stage(name)

    model_state = {k: v for k, v in model_state.items() if mine(k)}
    if any(isinstance(p, int) for group in optimizer_state["param_groups"]
           for p in group["params"]):
        raise UsageError("this checkpoint numbers its optimizer state by position (written "
                         "by an older shoal): resume it without pipeline parallelism first")
    optimizer_state = {
        "state": {k: v for k, v in optimizer_state["state"].items() if mine(k)},
        "param_groups": [{**g, "params": [p for p in g["params"] if mine(p)]}
                         for g in optimizer_state["param_groups"]]}
    return model_state, optimizer_state


def _check_model_fits(path: Path, saved: dict, live: dict) -> None:
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    shapes = sorted(f"{k} (checkpoint {list(saved[k].shape)}, model {list(live[k].shape)})"
                    for k in set(saved) & set(live) if saved[k].shape != live[k].shape)
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, keys in (("not in checkpoint", missing), ("not in model", unexpected),
                        ("shape differs", shapes)):
        if keys:
            shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            parts.append(f"{label}: {shown}")
    raise CheckpointError(f"checkpoint {path} does not fit the model; " + "; ".join(parts))
