"""What a Trainer records of its steps: the step metrics, where this process writes them
(``shoal.metrics.recorder``), and in a live job each group's figures of the steps not yet
written (``shoal.metrics.unwritten``), which the next group to write them writes (see
``shoal.training.live``).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from shoal.metrics.recorder import StepMetrics
from shoal.metrics.steps import StepClock
from shoal.metrics.unwritten import UnwrittenSteps
from shoal.training.live import step_figures

Trainer = Any  # a shoal.Trainer (not imported: its module imports this one)


class Recording:
    """A Trainer's step metrics during ``fit``: opened at its start, told of each
    micro-batch and step, closed at its end."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.metrics: StepMetrics | None = None
        """Where this process writes the step metrics (rank 0 writes the files)."""
        self.unwritten: UnwrittenSteps | None = None
        """A live job's: this rank's figures of the steps not yet written."""
        self._loss: torch.Tensor | int = 0  # the window's losses (a tensor once one is in)
        self._samples = self._tokens = 0

    def open(self, writes: bool, resumed: bool) -> None:
        """At the start of ``fit``, from the state's step; ``writes``: this process's group
        writes the metrics (in a live job, group 0, until the first quorum says)."""
        t = self.trainer
        if not t.config.metrics.enabled:
            return
        if writes:
            self.open_metrics(t.global_step, resumed)
        if t.live is not None:
            self.unwritten = UnwrittenSteps(t.state, t.config.metrics.every)

    @property
    def on(self) -> bool:
        """The steps' figures are recorded (written here or not)."""
        return self.metrics is not None or self.unwritten is not None

    @property
    def clock(self) -> StepClock | None:
        return self.metrics.clock if self.metrics is not None else None

    def open_metrics(self, start_step: int = 0, resumed: bool = False) -> StepMetrics:
        """This process's step metrics, from ``start_step`` (marked at once, but in a live
        job: ``StepMetrics.started``). A live group that takes over from group 0 logs to no
        tracker's run: group 0's stay open, to be continued by it."""
        t = self.trainer
        c, h = t.config, t.harness
        taking_over = t.live is not None and not t.live.writes
        self.metrics = StepMetrics(
            c.metrics.untracked() if taking_over else c.metrics,
            h.device, h.rank, h.world_size, t.flops_per_token, c.precision,
            start_step=start_step, resumed=resumed,
            params=t.run_config or {"trainer": c.model_dump(mode="json")},
            tracking=t.tracking, announce=t.live is None,
            trackers=list(t.trackers) if not taking_over else [])
        if t.checkpointing:  # a checkpoint's steps are written before it is
            t.checkpointing.before_save = self.metrics.sync
        return self.metrics

    def close_metrics(self) -> None:
        """Stop writing (at the end of ``fit``, or a live group that another takes over
        from)."""
        if self.metrics is not None:
            self.metrics.close()
        self.metrics = None
        if self.trainer.checkpointing:
            self.trainer.checkpointing.before_save = None

    def record(self, type_: str, step: int, /, **fields: Any) -> None:
        """A line in metrics.jsonl, where this process writes them."""
        if self.metrics is not None:
            self.metrics.record(type_, step, **fields)

    def begin_epoch(self) -> None:
        if self.metrics is not None:
            self.metrics.clock.begin()
        if self.unwritten is not None:
            self.unwritten.begin()

    def begin_window(self) -> None:
        """Before a step's first micro-batch."""
        self._loss, self._samples, self._tokens = 0, 0, 0

    def add(self, loss: torch.Tensor, samples: int, tokens: int) -> None:
        """A micro-batch's loss, and the samples and tokens this rank counts of it."""
        self._loss = self._loss + loss.detach()
        self._samples += samples
        self._tokens += tokens

    def step(self, micro_batches: int) -> None:
        """After a step of ``micro_batches``: its figures (in a live job, the job's: see
        ``shoal.training.live.step_figures``)."""
        t = self.trainer
        h, state = t.harness, t.state
        loss = cast(torch.Tensor, self._loss) / micro_batches  # (one micro-batch at least)
        figures = (loss, self._samples, self._tokens)
        if t.live is not None:  # every group's, as DDP over their ranks says
            figures = step_figures(t, *figures, micro_batches=micro_batches)
        lr = t.optimizer.param_groups[0]["lr"]
        if self.metrics is not None:
            self.metrics.step(state.global_step, state.epoch, lr, figures[0],
                              h.last_grad_norm, figures[1], figures[2], h.last_comm)
        if self.unwritten is not None and t.live is not None:
            self.unwritten.step(lr, figures[0], h.last_grad_norm, figures[1], figures[2],
                                h.last_comm.bytes, t.live.everyone)

    def finish(self, result: dict | None = None, show_summary: bool = True) -> None:
        """Collective, at the end of training (or of this part of it: ``result`` None)."""
        if self.metrics is None:
            return
        self.metrics.finish(show_summary=show_summary, result=result)
        if result is not None:
            self.metrics.record("event", self.trainer.global_step, kind="end")
