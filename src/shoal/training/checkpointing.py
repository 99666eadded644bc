"""Save and restore everything a Trainer needs to continue a run exactly.

A checkpoint holds the Trainer's ``TrainState`` (model, optimizer, LR scheduler, gradient
scaler, compression state, the step and epoch counters, the data position and the epoch's
loss so far) and every rank's RNG states. Resumed with another world size, the global batch
stays the same: accumulation is adjusted where it divides, and a clear error says what to
change where it does not.

Model and optimizer state are keyed by parameter name (``torch.distributed.checkpoint.
state_dict``), the same under every strategy: sharded tensors are saved as shards and loaded
into whatever layout the resuming strategy has, so a run saved under 'fsdp' on 2 processes
continues under 'ddp' on 1, and the reverse.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.tensor import DTensor

from shoal.checkpoint import CheckpointError, CheckpointStore, rng, tree
from shoal.checkpoint.store import read_info
from shoal.errors import UsageError
from shoal.ft.config import ReplicaPlace
from shoal.parallel.pipeline_parallel import placed_in_stage

# layers: up to remote/, which imports nothing of training: checkpoints hold a tier's state
from shoal.remote.module import remote_modules
from shoal.training.callbacks import Callbacks
from shoal.training.config import TrainerConfig
from shoal.training.harness import Harness
from shoal.training.settling import settle_after_resume
from shoal.training.state import TrainState, load_model_and_optimizer_state, unhooked


class Trainer(Protocol):
    """What checkpoints read from and restore into a ``shoal.Trainer`` (named here so that
    this module does not import the Trainer's, which imports this one)."""

    config: TrainerConfig
    harness: Harness
    state: TrainState
    run_config: dict | None
    tracking: dict[str, str]
    checkpointing: Checkpointing | None
    history: list[dict[str, float]]
    callbacks: Callbacks
    live: Any  # the live session while fit runs in a live job (shoal.ft.session), or None

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
        place = ReplicaPlace.from_environ()  # live replica groups may save a step at once
        self.group = place.group if place else None
        """This process's replica group in a live job (None: not a live job)."""
        self._exact = place is not None and place.config.policy == "exact"
        self._groups = place.groups if place else None
        # 'exact', where each group holds a state of its own (error feedback, a replica):
        # a resume takes a step every group kept its own part of
        self._parts_needed = self._exact and (
            trainer.config.strategy in ("local_sgd", "diloco")
            or trainer.config.compression.name in ("powersgd", "topk"))
        self.store = CheckpointStore(directory, keep_last=keep_last, async_save=async_save,
                                     writer=f"group{place.group}" if place else "")
        self.every = every
        self.every_seconds = every_seconds
        self.saved_step = -1
        self.saved_at = time.monotonic()
        self._opened = time.time()  # (wall clock, as a checkpoint's files are dated)
        self._requested = False  # a timed save was asked for and has not happened yet
        self.local = trainer.config.strategy in ("local_sgd", "diloco")
        self.final_step: int | None = None
        self.asked_step: int | None = None
        """A step a callback asked to save (``Trainer.save_checkpoint``)."""
        """The run's last step, where known: its checkpoint is written at the end of fit,
        after the final validation, so that it holds the run's final metrics (a run
        resumed from it has nothing to train and returns them)."""
        # Collective, called by every rank first thing in a save (the step metrics' flush).
        self.before_save: Callable[[], None] | None = None

    def plan(self, total_steps: int | None) -> None:
        """The run's last step, ``total_steps`` where every rank counts the same (else
        none: a rank that skipped the periodic save of a step the others make would leave
        them waiting in its collective). Collective."""
        final = total_steps
        if dist.is_initialized() and dist.get_world_size() > 1:
            given = -1 if total_steps is None else total_steps
            bounds = torch.tensor([given, -given], device=self.trainer.harness.device)
            dist.all_reduce(bounds, op=dist.ReduceOp.MIN)
            final = total_steps if int(bounds[0]) == -int(bounds[1]) == given else None
        self.final_step = final

    def time_due(self) -> bool:
        """Rank 0's clock says a timed checkpoint is due (the ranks then agree on a step);
        said once, until the save happens."""
        due = (self.every_seconds is not None and self.trainer.harness.is_main
               and not self._requested
               and time.monotonic() - self.saved_at >= self.every_seconds)
        self._requested = self._requested or due
        return due

    def after_step(self, redone: bool = False, saves: bool = True) -> None:
        """A checkpoint when one is due (``saves``: this process's group writes the
        checkpoints; in a live job the others keep their own part of it, ``save_own``).
        ``redone``: the step was done again, bitwise as it was the first time (a live
        replacement redoing its group's steps under 'exact'): its checkpoint is written
        only where the group before it did not complete one."""
        step = self.trainer.state.global_step
        due = (self.every and step % self.every == 0) or step == self.asked_step
        if not due or step == self.final_step:
            return
        self.save_step(saves, redone)

    def save_step(self, saves: bool = True, redone: bool = False) -> None:
        """This step's checkpoint, unless it has one already (``after_step``'s ``saves``
        and ``redone``; collective)."""
        step = self.trainer.state.global_step
        if step == self.saved_step:
            return
        if not saves:
            self.save_own()
            return
        if redone and self._complete(step):
            self.saved_step = step
            return
        self.save()

    def save_own(self) -> None:
        """A live group that does not write the checkpoints keeps its own part of the
        step's (its ranks' error feedback, or under local_sgd and diloco their replicas),
        which differs from the writing group's: every group that resumes from the step
        then holds what it held (collective inside the group)."""
        if self.group is None:
            return
        _, own, _ = self._parts()
        if self.local or (own.get("comm") or {}).get("state"):  # (else nothing of its own)
            self.store.save_own(self.trainer.state.global_step, self.group, own)
        self.saved_step = self.trainer.state.global_step

    def saved_by_another(self) -> bool:
        """A live replica group, stopped by a preemption signal: another group committed
        this step's checkpoint while this process ran (collective). Every group holds the
        same state at a step, and a signal may reach the groups a step apart: the one it
        reaches later fails its next step for want of the other, which saved and stopped,
        and need not save that step again."""
        return bool(self.store.writer) and self._complete(self.trainer.state.global_step,
                                                          since=self._opened)

    def _complete(self, step: int, since: float | None = None) -> bool:
        """A complete checkpoint of ``step`` is there (committed at or after ``since``, a
        wall clock time, where given), as rank 0 sees it (collective)."""
        store = self.store
        found = [store.problem(store.path_for(step)) is None if since is None
                 else store.committed_since(step, since)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def save(self) -> Path | None:
        t = self.trainer
        if self.before_save is not None:
            self.before_save()
        if not _finite(t):
            _say(t, f"not saving step {t.state.global_step}: the model holds NaN or Inf; the last "
                    "good checkpoint stays the newest")
            return None
        t.callbacks.fire("on_save_checkpoint", t, t.state.global_step)
        shared, own, meta = self._parts()
        path = self.store.save(t.state.global_step, shared, own, meta)
        t.callbacks.fire("on_checkpoint_saved", t, t.state.global_step, str(path))
        self.saved_step = t.state.global_step
        self.saved_at = time.monotonic()
        self._requested = False
        return path

    def _parts(self) -> tuple[dict, dict, dict]:
        """A checkpoint's parts: shared by every rank, this rank's own, and the counters
        and settings (collective)."""
        t = self.trainer
        state = t.state.state_dict()
        own = {"rng": state.pop("rng"), "comm": state.pop("comm")}
        # Under local_sgd / diloco every rank holds its own replica and optimizer state.
        replicas = own if self.local else {}
        replicas.update(model=state.pop("model"), optimizer=state.pop("optimizer"))
        shared = {"scaler": state.pop("scaler"), **({} if self.local else replicas)}
        if state["lr_scheduler"] is not None:
            shared["lr_scheduler"] = state["lr_scheduler"]
        del state["lr_scheduler"]
        c = t.config
        # The counters, the data position (None: the loader cannot resume mid-epoch; the
        # epoch restarts instead) and the epoch's loss so far.
        meta = {**state, "batch_size": c.batch_size,
                "global_batch": t.harness.data_ranks * c.batch_size * t.state.accumulate,
                "seed": c.seed, "trainer_config": c.model_dump(mode="json"),
                "run_config": t.run_config, "tracking": t.tracking,
                # the epochs' metrics so far: a run resumed when it had finished returns them
                "history": t.history,
                "remote": {name: m.tier_state() for name, m in remote_modules(t.module).items()},
                "group": self.group,  # the live group whose own part ``own`` is
                "groups": self._groups,
                # 'available': the samples the missing groups skipped, over the whole run
                "skipped_samples": t.live.skipped_samples if t.live is not None else 0}
        return shared, own, meta

    def resume(self, source: str, finished: Callable[[dict], bool] = lambda meta: False
               ) -> None:
        """Load the checkpoint ``source`` names ('auto': the newest complete one) into the
        Trainer's state: same step, same next sample, same random streams, and the epoch's
        loss so far. ``finished(meta)``: a checkpoint's counters are the run's end (a live
        group takes such a one without every group's own part: nothing is left to train,
        and the others may have ended)."""
        t = self.trainer

        def whole(path: Path) -> bool:
            info = read_info(path)
            return self._every_part(path) or (info is not None and finished(info["meta"]))
        path = Path(source) if source != "auto" else self.store.latest(
            whole=whole if self._parts_needed else None)
        if path is None:
            _say(t, f"no checkpoint in {self.store.root}; starting from the beginning")
            return
        live = get_model_state_dict(t.state_model)
        others = _other_stages(live) if t.harness.dims.pp_enabled else None
        shared, own, meta = self.store.load(path, like=self._layout() if t.harness.split
                                            else None, skip=others)
        own = self._own_part(path, own, meta)
        replicas = self._replicas(path, shared, own, meta)
        model_state, optimizer_state = replicas["model"], replicas["optimizer"]
        if t.harness.dims.pp_enabled:  # this stage's part of the whole model's state
            model_state, optimizer_state = _stage_part(model_state, optimizer_state, live)
        _check_model_fits(path, model_state, live)
        state = {"model": model_state, "optimizer": optimizer_state,
                 "scaler": shared["scaler"], "lr_scheduler": shared.get("lr_scheduler"),
                 "global_step": meta["global_step"],
                 "epoch": meta["epoch"],
                 # (named 'consumed' by earlier releases)
                 "position": meta["position"] if "position" in meta else meta["consumed"],
                 "accumulate": self._keep_global_batch(meta),
                 "skipped_steps": meta.get("skipped_steps", []),
                 "callbacks": meta.get("callbacks"),
                 # absent from checkpoints of earlier releases
                 "epoch_loss": meta.get("epoch_loss")}
        if own is not None:
            state["rng"] = own["rng"]
        if self._comm_applies(own, meta):
            state["comm"] = cast(dict, own)["comm"]
        t.state.load_state_dict(state)
        live_remote = remote_modules(t.module)
        for name, tier in meta.get("remote", {}).items():
            if name in live_remote:
                live_remote[name].load_tier_state(tier)
        if t.harness.dims.tp_enabled:
            # A rank's saved streams may come from another layout: the tp ranks of a dp
            # rank must draw the same numbers (replicated activations, dropout).
            states = [rng.capture()]
            assert t.harness.mesh is not None  # built by the setup of a tp model
            dist.broadcast_object_list(states, group=t.harness.mesh["tp"].get_group(),
                                       group_src=0)
            rng.restore(states[0])
        t.tracking = dict(meta.get("tracking") or {})  # the MLflow run to continue
        t.history = [dict(epoch) for epoch in meta.get("history") or []]
        if t.live is not None:  # (a heal brings a live group's count instead)
            t.live.skipped_samples = meta.get("skipped_samples", 0)
        if t.state.global_step > 0:  # DDP cuts its buckets as the run did (settling)
            settle_after_resume(t)
        self.saved_step = t.state.global_step
        writes = (f"new checkpoints go to {self.store.root}" if t.checkpointing is self
                  else "no new checkpoints are written (checkpoint_dir is unset)")
        _say(t, f"resumed from {path} (step {t.state.global_step}, epoch {t.state.epoch}, "
                f"saved by {meta['world_size']} processes); {writes}")

    def _every_part(self, path: Path) -> bool:
        return self.store.has_own(path, self.trainer.harness.world_size)

    def restore_own(self, step: int) -> None:
        """Load this group's own part of the checkpoint of ``step`` (``save_own``, or the
        checkpoint's own where this group wrote it), over the state: a live group that took
        another's copy of a step both resumed (every group lost at once) holds its own
        error feedback (and under local_sgd and diloco its own replica) again."""
        own = self.store.load_own(self.store.path_for(step), self.group) \
            if self.group is not None else None
        if own is None:
            return
        t = self.trainer
        if self.local:
            load_model_and_optimizer_state(t.state.model, t.state.optimizer, own["model"],
                                           own["optimizer"])
        if (own.get("comm") or {}).get("state"):
            t.harness.load_comm_state_dict(own["comm"]["state"])

    def _own_part(self, path: Path, own: dict | None, meta: dict) -> dict | None:
        """This rank's own part of the checkpoint: the one it holds, or in a live job, its
        group's (``save_own``) where another group wrote the checkpoint."""
        writer = meta.get("group")
        if self.group is None or writer is None or writer == self.group:
            return own
        mine = self.store.load_own(path, self.group)
        if mine is None and self._exact and own is not None and \
                (own.get("comm") or {}).get("state"):
            _say(self.trainer, f"replica group {self.group} kept no part of its own of "
                               f"{path.name} (no checkpoint here holds every group's): its "
                               f"ranks take group {writer}'s {own['comm']['kind']} state")
        return own if mine is None else mine

    def _layout(self) -> dict[str, torch.Tensor]:
        """Empty tensors shaped like this rank's shards, for DCP to load each rank's part
        into (rather than every rank reading whole tensors), under both prefixes a
        checkpoint may file them under."""
        t = self.trainer
        with unhooked(t.state.optimizer):  # a fresh optimizer's state is created, to load into
            model_state, optimizer_state = get_state_dict(t.state_model, t.state.optimizer)
        _, tensors = tree.split({"model": model_state, "optimizer": optimizer_state}, "shared")
        like = {k: torch.empty_like(v) for k, v in tensors.items()}
        own = f"rank{t.harness.rank}"
        return {**like, **{own + k.removeprefix("shared"): v for k, v in like.items()}}

    def _comm_applies(self, own: dict | None, meta: dict) -> bool:
        """The checkpoint's compression or weight averaging state can continue exactly."""
        t = self.trainer
        saved = (own or {}).get("comm") or {}
        if not saved.get("state"):
            return False
        if saved["kind"] != t.harness.comm_kind:
            _say(t, f"the checkpoint's {saved['kind']} state does not apply to "
                    f"{t.harness.comm_kind}: starting it afresh")
        elif meta["world_size"] != t.harness.world_size:
            _say(t, f"world size {t.harness.world_size} differs from the checkpoint's "
                    f"{meta['world_size']}: the per-rank {saved['kind']} state (error "
                    "feedback) starts afresh")
        else:
            return True
        return False

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

    def _keep_global_batch(self, meta: dict) -> int:
        """The accumulation that keeps the checkpoint's global batch on these ranks."""
        t = self.trainer
        world, batch = t.harness.data_ranks, t.config.batch_size
        global_batch = meta["global_batch"]
        if global_batch == world * batch * t.state.accumulate:
            return t.state.accumulate
        if global_batch % (world * batch):
            raise UsageError(
                f"the checkpoint's global batch is {global_batch} samples, which "
                f"{world} data-parallel ranks x batch_size {batch} cannot make up; use a "
                f"batch_size that divides "
                f"{global_batch // world if global_batch % world == 0 else '?'} or a "
                f"data-parallel degree that divides {global_batch // batch}")
        accumulate = global_batch // (world * batch)
        _say(t, f"{world} data-parallel ranks x batch_size {batch} differ from the "
                f"checkpoint's layout ({meta['world_size']} processes): accumulating "
                f"{accumulate} micro-batches to keep the global batch of {global_batch}")
        return accumulate


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
