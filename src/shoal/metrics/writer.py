"""Rank 0's metrics file: JSON lines, in the run directory (TensorBoard's events:
``shoal.metrics.trackers``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

JSONL = "metrics.jsonl"
_CHUNK = 1 << 16  # bytes read at a time from the end of the file (``last_step``)


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

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.dir / JSONL, "a", buffering=1)  # noqa: SIM115 - closed in close

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

    def close(self) -> None:
        self._file.close()
