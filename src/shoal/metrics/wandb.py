"""Weights & Biases: rank 0's run, as a ``shoal.Tracker`` (``trainer.metrics.wandb``).

The one module that meets wandb. The run is opened with the resolved run config as its
config, fed each metrics window's figures by step, given the end-of-run table and the final
metrics (its summary) at the end. A restart or a resume continues the same run (its id is
kept; ``resume='allow'``); steps a resume does again are not logged twice (W&B keeps a
run's steps increasing). ``mode: offline`` writes the run under the run directory's
``wandb/``, for ``wandb sync`` later.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shoal.extras import install_line
from shoal.metrics.tracker import Tracker

INSTALL = install_line("wandb")


class WandbConfig(BaseModel):
    """Where rank 0 logs the run in Weights & Biases (the ``trainer.metrics.wandb``
    section; true: W&B's defaults). The API key comes from ``wandb login`` or
    $WANDB_API_KEY, as for any W&B run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    project: str | None = None
    """Project of the run; default: $WANDB_PROJECT, else 'shoal'."""
    entity: str | None = None
    """Team or user; default: $WANDB_ENTITY, else the API key's default."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """'offline': files only, synced later with `wandb sync`; default: $WANDB_MODE, else
    online."""
    run_name: str | None = None
    """Name of a new run; default: the run directory's name (shoal train)."""
    run_id: str | None = None
    """Log into this run; default: the run a resumed checkpoint (or the restarted job) logged
    to, else a new one."""
    group: str | None = None
    """W&B's run group (runs of one sweep or experiment)."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the run."""
    dir: str | None = None
    """Where wandb keeps its files (wandb/); default: the metrics directory."""

    @model_validator(mode="after")
    def _installed(self) -> WandbConfig:
        if importlib.util.find_spec("wandb") is None:
            raise ValueError(f"Weights & Biases logging needs the wandb package: {INSTALL}")
        return self


def _say(message: str) -> None:
    print(f"shoal: {message}", file=sys.stderr, flush=True)


class WandB(Tracker):
    """A W&B run, opened on rank 0."""

    name = "wandb"

    def __init__(self, config: WandbConfig, directory: str | None = None):
        self.config = config
        self.directory = config.dir or directory
        self.run: Any = None
        self._pending: dict[int, dict[str, float]] = {}
        self._last = -1  # the last step logged (W&B drops a step below it)

    def start(self, params: dict[str, Any], run_name: str | None,
              resume_id: str | None) -> str | None:
        import wandb

        c = self.config
        run_id = c.run_id or resume_id or uuid.uuid4().hex[:8]
        if self.directory:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=c.project or os.environ.get("WANDB_PROJECT") or "shoal",
                entity=c.entity, mode=c.mode, name=c.run_name or run_name, id=run_id,
                resume="allow", group=c.group, tags=c.tags or None, dir=self.directory,
                config=params, settings=wandb.Settings(silent=True, console="off"))
        except Exception as exc:  # noqa: BLE001 - the run trains on without W&B
            _say(f"W&B: cannot open run {run_id} ({' '.join(str(exc).split())[:200]}); "
                 "training goes on without W&B")
            return None
        self._last = max(self.run.starting_step - 1, -1)
        where = self.run.dir if self.run.offline else self.run.url
        _say(f"W&B run {run_id}{' continued' if resume_id else ''} ({where})")
        return str(run_id)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        if self.run is not None and step > self._last:
            self._pending.setdefault(step, {}).update(values)

    def flush(self) -> None:
        if self.run is None:
            return
        for step in sorted(self._pending):
            self.run.log(self._pending[step], step=step)
            self._last = step
        self._pending = {}

    def wait(self) -> None:
        self.flush()

    def log_text(self, text: str, name: str) -> None:
        if self.run is not None:
            path = Path(self.run.dir) / name
            path.write_text(text)
            self.run.save(str(path), base_path=self.run.dir, policy="now")

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        if self.run is not None:  # the final metrics: the run's summary
            self.run.summary.update({k: v for k, v in data.items()
                                     if isinstance(v, (int, float, str))})

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.flush()
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)
            self.run = None
