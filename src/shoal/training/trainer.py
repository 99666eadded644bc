"""`shoal.Trainer`: a data-parallel training loop with accumulation, precision and validation."""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shoal.checkpoint import rng
from shoal.checkpoint.weights import read_state_dict
from shoal.data.sharding import (
    agreed_batches,
    agreed_length,
    position_after,
    samples_between,
    set_epoch,
)
from shoal.errors import NonFiniteError, Preempted, UsageError
from shoal.ft import ReplicaPlace
from shoal.ft.step import StepOutcome
from shoal.metrics.tracker import Tracker
from shoal.parallel.pipeline_parallel import PipelineModel

# layers: up to remote/, which imports nothing of training: a RemoteModule stays whole
from shoal.remote.module import remote_modules

# layers: up to remote/, as above: the layouts that would split a RemoteModule are remote's rule
from shoal.remote.tier import splits_parameters
from shoal.runtime.heartbeat import heartbeat
from shoal.runtime.seeds import seed_everything
from shoal.training.batches import (
    LossFn,
    StepFn,
    check_loss_functions,
    loss_of,
    pipeline_pair,
    samples_in,
    tokens_in,
)
from shoal.training.callbacks import Callback, Callbacks, build_callbacks
from shoal.training.checkpointing import Checkpointing
from shoal.training.config import TrainerConfig
from shoal.training.evaluation import validate
from shoal.training.harness import Harness
from shoal.training.live import (
    before_backward,
    begin_step,
    check_loader,
    end_step,
    open_live,
)
from shoal.training.preemption import PreemptionWatch
from shoal.training.preemption import exit_code as preemption_exit_code
from shoal.training.profiling import StepProfiler
from shoal.training.progress import Progress
from shoal.training.recording import Recording
from shoal.training.settling import settle
from shoal.training.state import TrainState, load_model_weights

if TYPE_CHECKING:
    from shoal.ft.session import LiveSession


def _all_gather_flags(flag: bool) -> list[bool]:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [flag]
    flags: list[bool] = [False] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(flags, flag)
    return flags


def _run_ends(epochs: int | None, max_steps: int | None, step: int, epoch: int,
              stop_reason: str | None) -> bool:
    """A run at ``step`` and ``epoch`` has ended: it reached ``max_steps`` or ``epochs``, or
    a callback stopped it (a checkpoint's counters say the same of the run it saved)."""
    return ((max_steps is not None and step >= max_steps)
            or (epochs is not None and epoch >= epochs) or stop_reason is not None)


def _rescale_gradients(model: nn.Module | PipelineModel, factor: float) -> None:
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(factor)


class Trainer:
    """Train ``model`` with ``optimizer`` on every process of the job.

    Settings are the fields of ``TrainerConfig`` (strategy, precision, batch_size,
    accumulate_grad_batches, clip_grad_norm, epochs, max_steps, seed, ...).
    Batches may be ``(inputs, targets)`` pairs, mappings (``model(**batch)``), dataclasses,
    ... (see ``shoal.training.batches``). The loss is ``loss_fn(outputs, targets)`` for a
    pair (default cross-entropy), ``loss_fn(outputs, batch)`` for any other batch (default:
    the model's own ``outputs.loss``), or ``step_fn(model, batch)`` instead of both; it
    must average over the batch.
    ``lr_scheduler`` is a scheduler, or a function of the optimizer returning one; it is
    stepped after every optimizer step. ``tp_plan`` (module-name pattern -> torch
    ParallelStyle) replaces the ready tensor-parallel plan when ``parallel.tp`` > 1.
    ``callbacks``: ``shoal.Callback`` objects, or import paths as in a run config's
    ``trainer.callbacks``; their hooks run at the loop's points (see shoal.Callback).
    ``trackers``: ``shoal.Tracker`` objects rank 0 logs the run to, beside those
    ``metrics`` names (TensorBoard, MLflow, W&B, import paths).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 loss_fn: LossFn | None = None, step_fn: StepFn | None = None,
                 lr_scheduler: Any = None, tp_plan: dict | None = None,
                 callbacks: Sequence[Callback | str | Mapping[str, Any]] = (),
                 trackers: Sequence[Tracker] = (), **settings: Any):
        """Validate the settings, join the process group and set up model and optimizer.

        Raises:
            UsageError: If a setting is unknown, invalid or does not fit this job (backend,
                parallel degrees), ``loss_fn`` and ``step_fn`` are both given or do not take
                two arguments, ``step_fn`` is given under pipeline parallelism, the model
                does not fit the strategy (see ``Harness.setup``; a RemoteModule under zero2,
                fsdp, tp or pp), ``lr_scheduler`` is built on an optimizer that the
                strategy replaces, or one of ``callbacks`` is no ``shoal.Callback`` (or
                its import path names nothing).
            ValueError: If the launcher's environment is incomplete (see ``shoal.init``).
            RuntimeError: If the process group cannot form, or a collective of the setup
                fails (a peer died; DDP finds that the ranks' models differ).
        """
        # (the config keeps those given by import path: a run's config.yaml names them)
        self.config = TrainerConfig.build(
            callbacks=[s for s in callbacks if isinstance(s, (str, Mapping))], **settings)
        c = self.config
        check_loss_functions(loss_fn, step_fn)
        if step_fn is not None and c.parallel.pp_enabled:
            raise UsageError("pipeline parallelism computes the loss on the last stage from "
                             "loss_fn(outputs, targets); step_fn cannot run there")
        why = splits_parameters(c.strategy, c.parallel.tp, c.parallel.pp)
        if why and remote_modules(model):
            raise UsageError(f"the model has a RemoteModule: {why}")
        self.harness = Harness(c.strategy, c.precision, backend=c.backend, ddp=c.ddp,
                               compression=c.compression, local_sgd=c.local_sgd,
                               diloco=c.diloco, fsdp=c.fsdp, parallel=c.parallel,
                               tensor_parallel=c.tensor_parallel, pipeline=c.pipeline,
                               tp_plan=tp_plan,
                               activation_checkpointing=c.activation_checkpointing,
                               blocks=c.blocks, compile=c.compile, seed=c.seed,
                               live=ReplicaPlace.from_environ() is not None)
        # Each dp rank gets its own stream of random numbers (dropout); its tp and pp ranks
        # share it, as they compute parts of one forward. The data order comes from the
        # sampler's seed and is the same on every rank.
        seed_everything(c.seed + self.harness.dp_rank)
        # Asked of the whole model, before a strategy splits or wraps it.
        flops = getattr(model, "flops_per_token", None)
        self.flops_per_token: float | None = flops() if callable(flops) else flops
        self.loss_fn, self.step_fn = loss_fn, step_fn
        # A pipeline's last stage needs a loss of (outputs, targets) from the start.
        self.model, self.optimizer = self.harness.setup(model, optimizer,
                                                        loss_fn or F.cross_entropy)
        self.pipeline = isinstance(self.model, PipelineModel)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(self.optimizer)
        elif getattr(lr_scheduler, "optimizer", self.optimizer) is not self.optimizer:
            raise UsageError(f"strategy '{c.strategy}' replaces the optimizer, so a scheduler "
                             "built on it would change a learning rate nobody uses: pass "
                             "lr_scheduler as a function of the optimizer (e.g. lambda opt: "
                             "torch.optim.lr_scheduler.StepLR(opt, 10))")
        self.lr_scheduler = lr_scheduler
        # What a step changes: what checkpoints save and a replacement group heals from.
        self.state = TrainState(self.harness, self.state_model, self.optimizer, lr_scheduler,
                                c.accumulate_grad_batches)
        self.callbacks = Callbacks(build_callbacks(callbacks) + self._own_callbacks())
        self.state.callbacks = self.callbacks  # (their states travel with the run's)
        self._initialized = False  # fit took init_from's weights (or needed none)
        self._val_data: Dataset | DataLoader | None = None  # fit's, for val_every_steps
        self._epoch_started: int | None = None  # the epoch on_epoch_start was called for
        self._validated: tuple[int, dict[str, float]] | None = None  # the last: step, figures
        self.live: LiveSession | None = None  # the live session while fit runs in a live job
        self.history: list[dict[str, float]] = []
        self._preemption: PreemptionWatch | None = None
        self.recording = Recording(self)
        """The step metrics while fit runs."""
        self.run_config: dict | None = None  # the resolved run config, kept in checkpoints
        # The trackers' run ids, kept in checkpoints: a resumed run logs into the same runs.
        self.tracking: dict[str, str] = {}
        self.trackers = list(trackers)
        self.checkpointing = Checkpointing(
            self, c.checkpoint_dir, c.checkpoint_every, c.keep_last, c.async_checkpoint,
            c.checkpoint_every_seconds) if c.checkpoint_dir else None

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (skipped ones included)."""
        return self.state.global_step

    @property
    def epoch(self) -> int:
        """The epoch under way (epochs completed so far)."""
        return self.state.epoch

    @property
    def skipped_steps(self) -> list[int]:
        """Steps skipped for non-finite gradients (``nonfinite='skip'``)."""
        return self.state.skipped_steps

    @property
    def module(self) -> nn.Module:
        """The user's model, without the strategy's wrapper (under pipeline parallelism:
        this rank's stage, under the model's own parameter names)."""
        if isinstance(self.model, PipelineModel):
            return self.model.stage
        return getattr(self.model, "module", self.model)

    @property
    def reports(self) -> bool:
        """This process shows the run's progress and end lines and writes its final
        metrics: rank 0; in live mode, of the group that writes for all
        (``LiveSession.reports``: every group reports the same figures)."""
        return self.harness.is_main and (self.live is None or self.live.reports)

    @property
    def writes_metrics(self) -> bool:
        """This process writes the run's final metrics (``shoal train``'s metrics.json):
        rank 0, of every live group (they end with the same figures but timings, and the
        group that reports may be lost after its end)."""
        return self.harness.is_main

    @property
    def _saves(self) -> bool:
        """This process's group writes the checkpoints now: in a live job, the first group
        in the last quorum (group 0 where it takes part; under 'available', while group 0
        is missing, the next: checkpoints go on). The others hold the same state."""
        return self.live is None or self.live.saves

    @property
    def state_model(self) -> nn.Module:
        """What model state is read from and loaded into (a wrapper, or a stage)."""
        return self.model.stage if isinstance(self.model, PipelineModel) else self.model

    def _loader(self, data: Dataset | DataLoader, evaluation: bool,
                share: int | None = None) -> DataLoader:
        return self.harness.setup_dataloader(data, self.config.batch_size, shuffle=True,
                                             evaluation=evaluation,
                                             num_workers=self.config.num_workers, share=share)

    def fit(self, train_data: Dataset | DataLoader, val_data: Dataset | DataLoader | None = None,
            epochs: int | None = None, max_steps: int | None = None) -> dict[str, float]:
        """Train; validate after each epoch when ``val_data`` is given. Returns final metrics.

        With ``resume`` set, training continues where the checkpoint left off: same step,
        same next sample, same random state.

        Raises:
            UsageError: If the data or a setting does not fit: an epoch gives no batch, a
                batch has no countable samples or the model returns no loss, the loader
                cannot be split, the checkpoint to resume needs another strategy, process
                count or batch size, or live recovery runs without shoal's launcher.
            shoal.checkpoint.CheckpointError: If the checkpoint to resume from is incomplete
                or does not fit the model; the message names the keys that differ.
            NonFiniteError: If ``nonfinite='stop'`` and a step's gradients hold NaN or Inf;
                the message names the step and the ranks whose loss was not finite.
            RemoteTierError: If a RemoteModule's remote call fails, or on resume its tier
                serves another module than the checkpoint's.
            RuntimeError: If a collective fails (a peer died, or the group's timeout
                passed); in a live job, ``shoal.ft.step.LiveError`` when the replica
                groups do not meet in time.
            ValueError: If the resumed position in the epoch lies past the end of the
                training data (the dataset shrank).
            SystemExit: After a preemption signal (SIGTERM, SIGUSR1) with ``checkpoint_dir``
                set: the checkpoint is saved and the process exits with 128 + the signal.
        """
        c = self.config
        epochs = epochs or c.epochs
        max_steps = max_steps or c.max_steps
        if epochs is None and max_steps is None:
            epochs = 1
        self.live = open_live(self)  # before the loader: it splits data over the groups
        # One live group writes the metrics for all (group 0), and one the checkpoints: the
        # first in the step's quorum (group 0 where it takes part, see ``_saves``).
        writes = self.live is None or self.live.writes
        loader = self._loader(train_data, evaluation=False)
        if self.live is not None:
            check_loader(loader)
        if c.resume:  # a path without checkpoint_dir is read, and nothing is written
            directory = c.checkpoint_dir if c.resume == "auto" else str(Path(c.resume).parent)
            assert directory is not None  # the config requires checkpoint_dir for 'auto'
            reader = self.checkpointing or Checkpointing(self, directory, every=None,
                                                         keep_last=c.keep_last)
            reader.resume(c.resume, finished=lambda meta: _run_ends(
                epochs, max_steps, meta["global_step"], meta["epoch"],
                (meta.get("callbacks") or {}).get("stop_reason")))
            if self.global_step > 0:
                self.callbacks.fire("on_resume", self, self.global_step)
        if c.init_from and self.global_step == 0 and not self._initialized:
            load_model_weights(self.state_model, read_state_dict(c.init_from), c.init_from)
        self._initialized = True  # (a second fit goes on from the first's weights)
        if self.live is not None and self.checkpointing:
            self.live.own_part = self.checkpointing.restore_own
        total = self._total_steps(loader, epochs, max_steps)
        progress = Progress(total, enabled=c.progress and self.reports)
        if self.checkpointing:
            self.checkpointing.plan(total)
        # Resumed from a run that had finished: nothing to train, and its final metrics.
        metrics: dict[str, float] = dict(self.history[-1]) if self.history else {}
        if self.history and self._finished(epochs, max_steps) and self.harness.is_main:
            why = f" ({self.callbacks.stop_reason})" if self.callbacks.stop_reason else ""
            print(f"shoal: the run had finished at step {self.global_step}{why}: nothing "
                  "left to train; its final metrics stand", file=sys.stderr, flush=True)
        # Every live group watches for a preemption signal, and for timed saves: the group
        # that saves may change (``_saves``).
        self._preemption = PreemptionWatch(
            self.harness.device, waiting=self.live.waiting if self.live is not None else None
        ) if self.checkpointing else None
        if self._preemption and self.live is not None:
            self.live.before_wait = self._preemption.before_wait
        # (live: marked from the step the first quorum says, see training.live)
        self.recording.open(writes, resumed=bool(c.resume) and self.global_step > 0)
        self._val_data = val_data
        try:
            if self._preemption:
                self._preemption.start()
            self.callbacks.fire("on_fit_start", self)
            while not self._finished(epochs, max_steps):
                try:
                    ran = self._train_epoch(loader, progress, max_steps)
                except Preempted as stop:  # while waiting for the other replica groups
                    assert self.live is not None  # raised only while a live session waits
                    self.live.exit_on_close(preemption_exit_code(stop.signum))
                    self._stop_for(stop.signum, waited=True)
                if isinstance(ran, StepOutcome):  # live: a step done again, or healed
                    continue  # on from the state's step and data position
                train, epoch_done = ran
                if not epoch_done or self._finished(epochs, max_steps, self.epoch + 1):
                    self.harness.synchronize()  # replicas that train apart end as one
                metrics = {"epoch": self.epoch, **train}
                if val_data is not None:
                    metrics.update(self._validation(val_data))
                self.history.append(metrics)
                self._report_epoch(metrics, progress)
                self.callbacks.fire("on_epoch_end", self, metrics)
                if not epoch_done:  # stopped by max_steps inside the epoch
                    break
                self._checkpoint_asked(epochs, max_steps)
                self.state.next_epoch()
            if self.live is not None:
                self.live.finish(self.global_step)
            result = {**metrics, "global_step": self.global_step}
            self.recording.finish(result, show_summary=c.progress)
        except Exception as error:
            self.callbacks.fire("on_exception", self, error)
            raise
        finally:
            progress.close()
            if self._preemption:
                self._preemption.stop()
            self.recording.close_metrics()
            if self.live is not None:
                self.live.close()
        if self.checkpointing:
            if self.checkpointing.saved_step != self.global_step:
                # In a live job every group saves the last step (the first to commit it
                # keeps it): it is saved even where the group that writes is lost after it.
                # Each keeps its own part of it too, whichever group's commit stays.
                self.checkpointing.save_own()
                self.checkpointing.save()
            self.checkpointing.store.wait()  # an asynchronous save is committed before return
        self.callbacks.fire("on_fit_end", self, result)
        return result

    def _own_callbacks(self) -> list[Callback]:
        """shoal's own mechanisms that plug in at the hooks (after the user's)."""
        c = self.config
        if c.profile_steps is None:
            return []
        directory = c.profile_dir or str(Path(c.metrics.dir or ".") / "profile")
        return [StepProfiler(*c.profile_steps, directory)]

    def save_checkpoint(self) -> None:
        """Ask for a checkpoint of this step (from a callback's hook: every rank asks at the
        same step). It is written as the step's own, after the step's hooks, validation and
        stop: right after the step, after an epoch's end, or at the end of the run. In a
        live job the group that writes the checkpoints saves it, the others keep their own
        part of it.

        Raises:
            UsageError: If the Trainer has no ``checkpoint_dir``.
        """
        if self.checkpointing is None:
            raise UsageError("save_checkpoint needs a checkpoint_dir")
        self.checkpointing.asked_step = self.global_step

    def stop(self, reason: str = "a callback asked to stop") -> None:
        """Ask the run to stop (from a callback's hook): every rank stops after the same
        step, validates and saves as at the run's end; said in one line with ``reason``.

        Never raises."""
        self.callbacks.ask_stop(reason)

    def _validation(self, val_data: Dataset | DataLoader) -> dict[str, float]:
        """``validate``, recorded and given to the callbacks, keeping the random streams;
        once a step (the epoch's end takes the figures of a validation at its last step)."""
        if self._validated is not None and self._validated[0] == self.global_step:
            return self._validated[1]
        streams = rng.capture()  # (a loader's iterator draws its seed from them: the
        figures = self.validate(val_data)  # training's dropout is what it is without it)
        rng.restore(streams)
        self.recording.record("validation", self.global_step, epoch=self.epoch, **figures)
        self._validated = (self.global_step, figures)
        self.callbacks.fire("on_validation_end", self, {"step": self.global_step, **figures})
        return figures

    def _after_step(self, loss: torch.Tensor) -> bool:
        """After a step, before its checkpoint (which then holds the step's validation):
        the callbacks' step hook, a validation every ``val_every_steps``, and whether every
        rank agrees to stop now."""
        cb = self.callbacks
        if cb.wants("on_step_end"):
            cb.fire("on_step_end", self, {"step": self.global_step, "epoch": self.epoch,
                                          "loss": loss.item(),
                                          "lr": self.optimizer.param_groups[0]["lr"]})
        every = self.config.val_every_steps
        if every and self._val_data is not None and self.global_step % every == 0:
            self._validation(self._val_data)
        if cb.stop_agreed(self.harness.device):
            if self.harness.is_main:
                print(f"shoal: stopping after step {self.global_step}: {cb.stop_reason}",
                      file=sys.stderr, flush=True)
            return True
        return False

    def _finished(self, epochs: int | None, max_steps: int | None,
                  epoch: int | None = None) -> bool:
        return _run_ends(epochs, max_steps, self.global_step,
                         self.epoch if epoch is None else epoch, self.callbacks.stop_reason)

    def _total_steps(self, loader: DataLoader, epochs: int | None, max_steps: int | None
                     ) -> int | None:
        try:
            per_epoch = math.ceil(len(loader) / self.state.accumulate)
        except TypeError:
            return max_steps
        total = per_epoch * epochs if epochs is not None else None
        return min(x for x in (total, max_steps) if x is not None) if total or max_steps else None

    def _train_epoch(self, loader: DataLoader, progress: Progress, max_steps: int | None
                     ) -> tuple[dict[str, float], bool] | StepOutcome:
        """The epoch from the state's data position on: (metrics, reached its end); or, in
        a live job, a step's outcome that moves the run elsewhere (AGAIN: the step starts
        again where it began; HEALED: on from a live group's step)."""
        h, model, state = self.harness, self.model, self.state
        k = state.accumulate
        model.train()
        first = state.position or 0  # the epoch's samples before this pass
        if not set_epoch(loader, state.epoch, first) and first:
            state.restart_epoch()  # this loader cannot start mid-epoch: the epoch starts over
            first = 0
        if first == 0 and self._epoch_started != state.epoch:
            self._epoch_started = state.epoch
            self.callbacks.fire("on_epoch_start", self)
        length = agreed_length(loader, h.device)
        micro_batches = samples = 0
        traffic = h.traffic
        before = (traffic.steps, traffic.total_bytes, traffic.total_wait)
        start = time.perf_counter()
        stopped = False
        # A dp rank's tp and pp ranks read the same batch: one of them counts it.
        counts = h.tp_rank == 0 and h.pp_rank == 0
        recording = self.recording
        recording.begin_epoch()
        for i, (batch, last_batch) in enumerate(agreed_batches(loader, length, h.device)):
            # (read each time: in a live job another group's may take over, or this one's)
            clock = recording.clock
            if clock:
                clock.lap("data")
            position = i % k
            # An unsized loader's window length is known only at its end (see below).
            window = k if length is None else min(k, length - (i - position))
            step_now = position == window - 1 or last_batch
            if position == 0:  # the window's global sample count, once per window
                window_samples = samples_between(loader, i, i + window)
                recording.begin_window()
                if self.live is not None:  # meet the other replica groups (may heal)
                    outcome = begin_step(self)
                    if outcome is not StepOutcome.GO:
                        return outcome
            batch = h.to_device(batch)
            if position == 0:
                settle(self, batch)  # a resumed process cuts DDP's buckets as they were
            n = samples_in(batch)
            loss = self._forward_backward(batch, n, window, window_samples, step_now)
            if clock:
                clock.lap("forward_backward")
            state.epoch_loss.add(loss)
            micro_batches += 1
            samples += n
            if recording.on:
                recording.add(loss, n if counts else 0, tokens_in(batch) if counts else 0)
            if not step_now:
                continue
            if length is None and position + 1 < k:
                # The stream ended inside a window: its gradients were divided by k.
                _rescale_gradients(model, k / (position + 1))
            if self.live is not None:  # the mean over the groups
                outcome = end_step(self, window_samples)
                if outcome is not StepOutcome.COMMITTED:
                    return outcome
            self._optimizer_step(position_after(loader, micro_batches), loss)
            if recording.on:
                recording.step(micro_batches=position + 1)
            if self._after_step(loss):  # (the step's validation comes before its save)
                stopped = not last_batch
                break  # (saved at the end, after the final validation)
            self._checkpoint_step()
            if progress.wants_update():
                rate = samples * h.data_ranks / (time.perf_counter() - start)
                progress.update(self.global_step, self.epoch, loss.item(), rate)
                if clock:
                    clock.skip()  # the display counts as 'other' of the next step
            if max_steps is not None and self.global_step >= max_steps:
                stopped = not last_batch
                break
        if micro_batches == 0 and first == 0:
            raise UsageError("the training data gave no batch this epoch (on every rank): "
                             "is the dataset smaller than world size x batch size?")
        metrics = {"train_loss": state.epoch_loss.mean(h.world_size)}
        steps = traffic.steps - before[0]
        if steps:  # this rank's view; the bytes are the same on every rank
            metrics.update(step_time_s=(time.perf_counter() - start) / steps,
                           comm_bytes_per_step=(traffic.total_bytes - before[1]) / steps,
                           comm_wait_s_per_step=(traffic.total_wait - before[2]) / steps)
        return metrics, not stopped

    def _forward_backward(self, batch: Any, samples: int, window: int,
                          window_samples: int | None, step_now: bool) -> torch.Tensor:
        """One micro-batch of ``samples`` in a window of ``window``: its loss; its gradients
        are added to the window's, which are all-reduced at the window's last micro-batch
        (``step_now``)."""
        h = self.harness
        if self.pipeline:  # forward and backward through every stage in one call
            inputs, targets = pipeline_pair(batch)
            return h.pipeline_step(cast(PipelineModel, self.model), inputs, targets,
                                   scale=self._weight(window, window_samples, samples))
        model = cast(nn.Module, self.model)
        with h.no_sync(model, enabled=not step_now):  # all-reduce once per window
            with h.autocast():
                loss = loss_of(model, batch, self.loss_fn, self.step_fn)
            if step_now and self.live is not None:
                before_backward(self, loss)  # the step's numbers start across the groups
            h.backward(self._scaled(loss, window, window_samples, samples))
        return loss

    def _non_finite(self, loss: torch.Tensor | None) -> None:
        """All ranks are here together: their all-reduced gradients are equally bad."""
        step = self.global_step + 1
        mine = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        culprits = [r for r, bad in enumerate(_all_gather_flags(mine)) if bad]
        where = (f"loss not finite on rank {', '.join(map(str, culprits))}" if culprits
                 else "loss finite everywhere: a gradient overflowed")
        if self.config.nonfinite == "stop":
            raise NonFiniteError(f"non-finite gradients at step {step} ({where}); set "
                                 "nonfinite='skip' to skip such steps")
        self.state.skipped_steps.append(step)
        if self.harness.is_main:
            print(f"shoal: skipped step {step}: non-finite gradients ({where})",
                  file=sys.stderr, flush=True)

    def _scaled(self, loss: torch.Tensor, window: int, total: int | None,
                samples: int) -> torch.Tensor:
        """The loss to back-propagate so that the window's gradient is its global mean.

        DDP averages over ranks, so with equal shares dividing by the window length is
        exact. A short final global batch gives ranks unequal shares: each rank's loss then
        counts by its share of the window's ``total`` samples (None: unknown, assume equal).
        """
        weight = self._weight(window, total, samples)
        if weight == 1 / window:  # equal shares: divided, as one process would
            return loss / window if window > 1 else loss
        return loss * weight

    def _weight(self, window: int, total: int | None, samples: int) -> float:
        """``_scaled``'s factor for a micro-batch of ``samples`` (a pipeline applies it
        itself)."""
        share = samples * self.harness.data_ranks
        return 1 / window if total is None or share * window == total else share / total

    def _optimizer_step(self, position: int | None, loss: torch.Tensor | None = None) -> None:
        """The step; the data position is then ``position``."""
        c = self.config
        clock = self.recording.clock
        if clock:
            clock.skip()
        stepped = self.harness.step(self.optimizer, model=self.model,
                                    clip_grad_norm=c.clip_grad_norm,
                                    check_finite=c.nonfinite is not None,
                                    measure_norm=self.recording.on and
                                    c.metrics.wants_grad_norm(self.global_step + 1))
        if clock:
            clock.lap("optimizer")
        if not stepped:
            self._non_finite(loss)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.state.step_taken(position)
        heartbeat(self.global_step)

    def _checkpoint_step(self) -> None:
        """After the step's metrics are recorded: a checkpoint when one is due (the figures
        of its steps are written first: a run killed after it loses none), and the stop a
        preemption signal asks for."""
        if self.checkpointing:
            self.checkpointing.after_step(redone=self.live is not None and self.live.redone,
                                          saves=self._saves)
            if self._preemption:
                signum, save_now = self._preemption.poll(
                    self._saves and self.checkpointing.time_due())
                if save_now and self._saves and \
                        self.checkpointing.saved_step != self.global_step:
                    self.checkpointing.save()
                if signum:
                    self._stop_for(signum)
            if self.recording.clock:
                self.recording.clock.skip()  # a save's time is the next step's 'other'

    def _checkpoint_asked(self, epochs: int | None, max_steps: int | None) -> None:
        """After an epoch's end (its validation and hooks): the checkpoint of its last step,
        where a callback asked for one then (``save_checkpoint``) and the run goes on (at
        its end, the final save is it)."""
        c = self.checkpointing
        if c is not None and c.asked_step == self.global_step and \
                not self._finished(epochs, max_steps, self.epoch + 1):
            c.save_step(self._saves, redone=self.live is not None and self.live.redone)

    def _stop_for(self, signum: int, waited: bool = False) -> NoReturn:
        """Every rank of the group is here at the same step: save, then exit with 128 +
        signal. In a live job the group that saves does (``_saves``); stopped while it
        ``waited`` for the others at a quorum, also a group that holds the last step while
        the group that saves may be the one missing (``LiveSession.saves_in_wait``), unless
        another group has saved that step since (``Checkpointing.saved_by_another``). A
        group that redoes its steps alone ('exact', a replacement) does not: the others
        wait for it at the quorum, holding a later step, and save that."""
        assert self.checkpointing is not None  # preemption is watched only with checkpoints
        saves = self.live.saves_in_wait if waited and self.live is not None else self._saves
        if self.live is not None and self.live.redone:
            saves = False  # redoing its steps alone: the others wait at a later one, and save
        if saves and self.checkpointing.saved_step != self.global_step:
            if self.checkpointing.saved_by_another():  # (live: another group's line says so)
                saves = False
            else:
                self.checkpointing.save()
        if not saves and self.live is not None and not self.live.redone and \
                self.checkpointing.saved_step != self.global_step:
            self.checkpointing.save_own()  # the group's own part of the step another saves
        self.checkpointing.store.wait()
        # the end-of-run table of this part of the run, in MLflow too
        self.recording.finish(show_summary=False)
        name = signal.Signals(signum).name
        if self.harness.is_main and saves:
            print(f"shoal: preempted by {name} at step {self.global_step}: checkpoint saved "
                  f"in {self.checkpointing.store.root}; exiting with code "
                  f"{preemption_exit_code(signum)}", file=sys.stderr, flush=True)
        raise SystemExit(preemption_exit_code(signum))

    def validate(self, val_data: Dataset | DataLoader) -> dict[str, float]:
        """Loss (and accuracy for class targets) over the whole validation set, all ranks.

        Raises:
            UsageError: If a batch has no countable samples, the model returns no loss, a
                batch under pipeline parallelism is not an (inputs, targets) pair, or the
                loader cannot be split.
            RemoteTierError: If a RemoteModule's remote call fails.
            RuntimeError: If a collective fails (a peer died, or the group's timeout passed).
        """
        return validate(self, val_data)

    def _report_epoch(self, metrics: dict[str, float], progress: Progress) -> None:
        if not progress.enabled:
            return
        parts = [f"epoch {metrics['epoch']}", f"train_loss {metrics['train_loss']:.4f}"]
        if "val_loss" in metrics:
            parts.append(f"val_loss {metrics['val_loss']:.4f}")
        if "val_accuracy" in metrics:
            parts.append(f"val_accuracy {metrics['val_accuracy']:.2%}")
        if metrics.get("comm_bytes_per_step"):
            parts.append(f"sent {metrics['comm_bytes_per_step'] / 1e3:.1f} kB/step")
        print(" · ".join(parts), flush=True)
