"""Rank 0's metrics files: JSON lines and TensorBoard events, in the run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shoal.extras import installed, require

JSONL = "metrics.jsonl"
_CHUNK = 1 << 16  # bytes read at a time from the end of the file (``last_step``)
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

    def last_step(self) -> int:
        """The step of the last step record in metrics.jsonl (0: none), read from its end
        (a live replacement of the writing group: where the one it replaces stopped)."""
        self._file.flush()
        with open(self.dir / JSONL, "rb") as file:
            end = file.seek(0, 2)
            tail = b""
            while end > 0:
                start = max(0, end - _CHUNK)
                file.seek(start)
                tail = file.read(end - start) + tail
                end = start
                lines = tail.split(b"\n")
                for line in reversed(lines[1:] if start else lines):  # whole lines only
                    if b'"type": "step"' in line:
                        try:
                            return int(json.loads(line)["step"])
                        except (ValueError, KeyError, TypeError):  # a line cut by a kill
                            continue
                tail = lines[0] if start else b""
        return 0

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
