"""A profiler window: one ``torch.profiler`` trace per rank of the steps ``first`` to
``last`` (``trainer.profile_steps: 20-25``, `shoal train --profile-steps 20-25`).

Every rank records the window's CPU (and CUDA) activity and writes
``DIR/rank<r>.pt.trace.json`` (``group<g>-rank<r>`` in a live job), a Chrome trace that
Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin open. The
step split of the step metrics says how much time each phase takes; the trace says which
kernel and which collective.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from shoal.training.callbacks import Callback

Trainer = Any  # a shoal.Trainer (not imported: its module imports this one)


class StepProfiler(Callback):
    """Profile steps ``first`` to ``last`` on every rank; the trace goes to ``directory``."""

    stops = False

    def __init__(self, first: int, last: int, directory: str | Path):
        self.first, self.last, self.directory = first, last, Path(directory)
        self._profile: Any = None

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.global_step + 1 >= self.first and trainer.global_step < self.last:
            self._start()

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        if self._profile is not None:
            self._profile.step()
            if step >= self.last:
                self._stop(trainer)
        elif step == self.first - 1:
            self._start()

    def on_fit_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self._profile is not None:  # the run ended inside the window
            self._stop(trainer)

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        if self._profile is not None:
            self._profile.stop()
            self._profile = None

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()

    def _stop(self, trainer: Trainer) -> None:
        profile, self._profile = self._profile, None
        profile.stop()
        group = os.environ.get("SHOAL_FT_GROUP")
        name = f"{f'group{group}-' if group is not None else ''}rank{trainer.harness.rank}"
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{name}.pt.trace.json"
        profile.export_chrome_trace(str(path))
        if trainer.harness.is_main:
            print(f"shoal: profiled steps {self.first} to {min(self.last, trainer.global_step)}"
                  f": {self.directory}/*.pt.trace.json, one per rank (open in "
                  "ui.perfetto.dev or TensorBoard)", file=sys.stderr, flush=True)
