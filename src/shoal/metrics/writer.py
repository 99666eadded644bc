"""Rank 0's metrics files: JSON lines and TensorBoard events, in the run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shoal.extras import installed, require

JSONL = "metrics.jsonl"
TENSORBOARD = "tensorboard"


def _clean(value: Any) -> Any:
    """NaN and infinities become null: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """The one writer of a run's metrics (rank 0): a line per record, flushed as written."""

    def __init__(self, directory: str | Path, tensorboard: bool | None = None):
        """``tensorboard``: True, False, or None (when the tensorboard package is
        installed)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.dir / JSONL, "a", buffering=1)  # noqa: SIM115 - closed in close
        self._tb = None
        if tensorboard is None:
            tensorboard = installed("tensorboard")
        elif tensorboard:
            require("tensorboard", "TensorBoard files of the step metrics")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / TENSORBOARD))

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(_clean(record)) + "\n")

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self._tb is None:
            return
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
