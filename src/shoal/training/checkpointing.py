"""Save and restore everything a Trainer needs to continue a run exactly.

A checkpoint holds model, optimizer, LR scheduler, gradient scaler, every rank's RNG
states, the step and epoch counters and the data position (global samples consumed in the
epoch). Resumed with another world size, the global batch stays the same: accumulation is
adjusted where it divides, and a clear error says what to change where it does not.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shoal.checkpoint import CheckpointError, CheckpointStore, rng
from shoal.errors import UsageError

if TYPE_CHECKING:
    from shoal.training.trainer import Trainer


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
        # Replicas are identical, so every rank reaches the same verdict without talking.
        if not all(bool(torch.isfinite(p).all()) for p in t.module.parameters()):
            _say(t, f"not saving step {t.global_step}: the model holds NaN or Inf; the last "
                    "good checkpoint stays the newest")
            return None
        shared = {"scaler": t.harness.precision.state_dict()}
        own = {"rng": rng.capture(), "comm": t.harness.comm_state_dict()}
        # Under local_sgd / diloco every rank holds its own replica and optimizer state.
        replicas = own if self.local else shared
        replicas.update(model=t.module.state_dict(), optimizer=t.optimizer.state_dict())
        if t.lr_scheduler is not None:
            shared["lr_scheduler"] = t.lr_scheduler.state_dict()
        c = t.config
        meta = {"global_step": t.global_step, "epoch": t.epoch,
                # None: the loader cannot resume mid-epoch; the epoch restarts instead.
                "consumed": consumed, "batch_size": c.batch_size,
                "global_batch": t.harness.world_size * c.batch_size * t.accumulate,
                "seed": c.seed, "trainer_config": c.model_dump(mode="json"),
                "run_config": t.run_config}
        path = self.store.save(t.global_step, shared, own, meta)
        self.saved_step = t.global_step
        self.saved_at = time.monotonic()
        self._requested = False
        return path

    def resume(self, source: str) -> int:
        """Load the checkpoint ``source`` names ('auto': the newest complete one).

        Returns the samples of the current epoch already consumed.
        """
        t = self.trainer
        path = self.store.latest() if source == "auto" else Path(source)
        if path is None:
            _say(t, f"no checkpoint in {self.store.root}; starting from the beginning")
            return 0
        shared, own, meta = self.store.load(path)
        replicas = self._replicas(path, shared, own, meta)
        _check_model_fits(path, replicas["model"], t.module.state_dict())
        t.module.load_state_dict(replicas["model"])
        t.optimizer.load_state_dict(replicas["optimizer"])
        t.harness.precision.load_state_dict(shared["scaler"])
        if t.lr_scheduler is not None and "lr_scheduler" in shared:
            t.lr_scheduler.load_state_dict(shared["lr_scheduler"])
        if own is not None:
            rng.restore(own["rng"])
        self._restore_comm(own, meta)
        t.global_step, t.epoch = meta["global_step"], meta["epoch"]
        self.saved_step = t.global_step
        self._keep_global_batch(meta)
        _say(t, f"resumed from {path} (step {t.global_step}, epoch {t.epoch}, "
                f"saved by {meta['world_size']} processes)")
        return meta["consumed"] or 0

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
        world, batch = t.harness.world_size, t.config.batch_size
        global_batch = meta["global_batch"]
        if global_batch == world * batch * t.accumulate:
            return
        if global_batch % (world * batch):
            raise UsageError(
                f"the checkpoint's global batch is {global_batch} samples, which "
                f"{world} processes x batch_size {batch} cannot make up; use a batch_size "
                f"that divides {global_batch // world if global_batch % world == 0 else '?'}"
                f" or a world size that divides {global_batch // batch}")
        t.accumulate = global_batch // (world * batch)
        _say(t, f"world size {world} differs from the checkpoint's {meta['world_size']}: "
                f"accumulating {t.accumulate} micro-batches to keep the global batch of "
                f"{global_batch}")


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
