"""Trackers: where rank 0 logs a run besides metrics.jsonl (TensorBoard, MLflow, Weights &
Biases, or a user's own).

A tracker is a ``shoal.Tracker``: it opens a run (or continues one), takes the figures of
each step and validation by step, the end-of-run table and final metrics, and ends the run.
Only rank 0 (of the group that writes the metrics, in a live job) holds trackers. The run
id a tracker returns is kept in every checkpoint and in the run directory, so a job
restarted after a failure, or resumed later from a checkpoint, logs into the same run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from shoal.imports import build_named
from shoal.metrics.tracker import Tracker
from shoal.metrics.wandb import WandB

IDS = "trackers.json"  # the run ids of a run's trackers, in its metrics directory

__all__ = ["MLflow", "TensorBoard", "Tracker", "WandB", "build", "start_all"]


class TensorBoard(Tracker):
    """TensorBoard event files in the metrics directory's ``tensorboard/``."""

    name = "tensorboard"

    def __init__(self, directory: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(Path(directory) / "tensorboard"))

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def finish(self, status: str) -> None:
        self._writer.close()


class MLflow(Tracker):
    """An MLflow run (``trainer.metrics.mlflow``; see shoal.metrics.mlflow)."""

    name = "mlflow"

    def __init__(self, config: Any):
        self.config = config
        self.run: Any = None

    def start(self, params: dict[str, Any], run_name: str | None,
              resume_id: str | None) -> str | None:
        from shoal.metrics.mlflow import MLflowRun

        self.run = MLflowRun.start(self.config, params, run_name=run_name,
                                   resume_id=resume_id)
        return self.run.run_id if self.run is not None else None

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log_metrics(step, values)

    def flush(self) -> None:
        if self.run is not None:
            self.run.flush()

    def wait(self) -> None:
        if self.run is not None:
            self.run.wait()

    def log_text(self, text: str, name: str) -> None:
        if self.run is not None:
            self.run.log_text(text, name)

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        if self.run is not None:
            self.run.log_dict(data, name)

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.end(status)
            self.run = None


def build(config: Any, given: list[Tracker] = ()) -> list[Tracker]:  # type: ignore[assignment]
    """The trackers a ``MetricsConfig`` asks for (TensorBoard, MLflow, W&B, its
    ``trackers`` by import path), then ``given`` (objects from code)."""
    from shoal.extras import installed

    built: list[Tracker] = []
    if config.dir and (config.tensorboard or (config.tensorboard is None
                                              and installed("tensorboard"))):
        built.append(TensorBoard(config.dir))
    if config.mlflow is not None:
        built.append(MLflow(config.mlflow))
    if config.wandb is not None:
        built.append(WandB(config.wandb, config.dir))
    built += [build_named(spec, f"trainer.metrics.trackers[{i}]", Tracker)
              for i, spec in enumerate(config.trackers)]
    return built + list(given)


def start_all(trackers: list[Tracker], params: dict[str, Any], directory: str | None,
              tracking: dict[str, str]) -> None:
    """Open each tracker's run: the one ``tracking`` (a resumed checkpoint's ids) names, or
    on a restart after a failure the one the run directory's ``trackers.json`` names, else
    a new one; each id kept in ``tracking`` and in that file."""
    ids = Path(directory) / IDS if directory else None
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    known = dict(tracking)
    if ids is not None and restarted and ids.is_file():
        try:
            known = {**json.loads(ids.read_text()), **known}
        except ValueError:  # a file cut by a kill: new runs
            pass
    name = os.path.basename(os.path.normpath(directory)) if directory else None
    for tracker in trackers:
        key = f"{tracker.name}_run_id"
        run_id = tracker.start(params, name, known.get(key))
        if run_id is not None:
            tracking[key] = run_id
    if ids is not None and tracking:
        partial = ids.with_name(f"{IDS}.{os.getpid()}.partial")
        partial.write_text(json.dumps(tracking))
        partial.replace(ids)


def finite(values: dict[str, float | None]) -> dict[str, float]:
    """``values`` without None and non-finite numbers (NaN: a figure not measured)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and math.isfinite(v)}
