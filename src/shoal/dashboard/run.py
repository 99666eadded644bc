"""What the dashboard knows of one run directory, kept up to date from its metrics.jsonl.

Step lines are thinned as a run grows: at most ``cap`` are kept, every ``stride``-th one,
and the stride doubles when the cap is reached, so a run of a million steps costs the page
a few thousand points. Thinned-out lines are not even parsed, except one whose loss is not
finite (that one is always kept). Windows of per-rank figures, validations and events
(start, resume, end) are few and all kept.

A job that restarts from a checkpoint at step S does again the steps after S: what was
recorded of them before the restart is dropped when the restart's start line arrives, so
the curves go on from the checkpoint, with the restart marked there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from shoal.dashboard.tail import LineTail

METRICS = "metrics.jsonl"
STEP_PREFIX = b'{"type": "step"'
WINDOW_PREFIX = b'{"type": "ranks"'
NONFINITE_LOSS = b'"loss": null'


class RunWatch:
    """One run directory: its points so far, and each poll's new ones."""

    def __init__(self, directory: str | Path, index: int, cap: int = 2000,
                 window_cap: int = 1000):
        self.dir = Path(directory)
        self.index = index
        self.name = self.dir.resolve().name
        self.cap, self.window_cap = cap, window_cap
        self.tail = LineTail(self.dir / METRICS)
        self.stride = 1
        self.window_stride = 1
        self.seen_steps = self.seen_windows = 0
        self.points: list[dict] = []
        self._numbers: list[int] = []  # each kept step line's place among all step lines
        self.windows: list[dict] = []  # 'ranks' records: every rank's figures per window
        self.validation: list[dict] = []
        self.events: list[dict] = []
        self.bad_lines = 0
        self.last_growth = time.time()  # when new bytes last arrived
        self.last_step: int | None = None

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].get("kind") == "end"

    def poll(self) -> dict | None:
        """Read what was appended; returns the new records (None: nothing new)."""
        new: dict = {"points": [], "windows": [], "validation": [], "events": []}
        before = (self.stride, self.window_stride)
        for block in self.tail.blocks():
            self._take_block(block, new)
        if self.tail.replaced:  # the file was started anew: so is everything known of it
            self.tail.replaced = False
            name = self.name
            self.__init__(self.dir, self.index, self.cap, self.window_cap)
            self.name = name
            return {**(self.poll() or {}), "reset": True}  # the page starts anew too
        if not any(new.values()):
            return None
        self.last_growth = time.time()
        replace = set(new.pop("replace", ()))
        if self.stride != before[0]:  # thinned: the page gets the whole list again
            replace.add("points")
        if self.window_stride != before[1]:
            replace.add("windows")
        for name in replace:
            new[name] = list(getattr(self, name))
        if replace:
            new["replace"] = sorted(replace)
        return new

    def _take_block(self, block: bytes, new: dict) -> None:
        # The loop a million-line file goes through: a step line that is thinned out costs
        # a prefix test and a modulo, nothing more (no attribute lookups).
        nonfinite = NONFINITE_LOSS in block
        seen, stride, is_step = self.seen_steps, self.stride, bytes.startswith
        for line in block.split(b"\n"):
            if is_step(line, STEP_PREFIX):
                seen += 1
                if seen % stride == 0 or (nonfinite and NONFINITE_LOSS in line):
                    self.seen_steps = seen
                    self._take_step(line, new)
                    stride = self.stride  # taking a step may double it
            else:
                self.seen_steps = seen
                self._take(line, new)
        self.seen_steps = seen

    def _take_step(self, line: bytes, new: dict) -> None:
        record = self._parse(line)
        if record is None:
            return
        self.last_step = record.get("step", self.last_step)
        self.points.append(record)
        self._numbers.append(self.seen_steps)
        new["points"].append(record)
        if len(self.points) > self.cap:
            self.stride *= 2
            kept = [i for i, (p, n) in enumerate(zip(self.points, self._numbers, strict=True))
                    if n % self.stride == 0 or p.get("loss") is None]
            self.points = [self.points[i] for i in kept]
            self._numbers = [self._numbers[i] for i in kept]

    def _take(self, line: bytes, new: dict) -> None:
        """A line that is not a step's."""
        window = line.startswith(WINDOW_PREFIX)
        if window:
            self.seen_windows += 1
            if self.seen_windows % self.window_stride:
                return
        elif not line.strip():
            return
        record = self._parse(line)
        if record is None:
            return
        kind = record.get("type")
        if kind == "ranks":
            if not window:
                self.seen_windows += 1
            self.windows.append(record)
            new["windows"].append(record)
            if len(self.windows) > self.window_cap:
                self.windows = self.windows[1::2]
                self.window_stride *= 2
        elif kind == "validation":
            self.validation.append(record)
            new["validation"].append(record)
        elif kind == "event":
            self.events.append(record)
            new["events"].append(record)
            if record.get("kind") in ("start", "resume"):
                self._redo_after(record.get("step", 0), new)

    def _redo_after(self, step: int, new: dict) -> None:
        """Forget what was recorded of the steps after ``step``: they are done again."""
        lists = {"points": lambda r: r["step"], "windows": lambda r: r["steps"][1],
                 "validation": lambda r: r["step"]}
        for name, step_of in lists.items():
            keep = [step_of(r) <= step for r in getattr(self, name)]
            if not all(keep):
                kept = [r for r, k in zip(getattr(self, name), keep, strict=True) if k]
                if name == "points":
                    self._numbers = [n for n, k in zip(self._numbers, keep, strict=True) if k]
                setattr(self, name, kept)
                new[name] = list(kept)
                new.setdefault("replace", []).append(name)

    def _parse(self, line: bytes) -> dict | None:
        try:
            record = json.loads(line)
        except ValueError:
            self.bad_lines += 1
            return None
        if not isinstance(record, dict):
            self.bad_lines += 1
            return None
        return record

    def snapshot(self) -> dict:
        return {"id": self.index, "name": self.name, "dir": str(self.dir),
                "points": self.points, "windows": self.windows,
                "validation": self.validation, "events": self.events,
                "stride": [self.stride, self.window_stride], "bad_lines": self.bad_lines}
