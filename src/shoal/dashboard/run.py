"""What the dashboard knows of one run directory, kept up to date from its metrics.jsonl.

Step lines are thinned as a run grows: at most ``cap`` are kept, every ``stride``-th one,
and the stride doubles when the cap is reached, so a run of a million steps costs the page
a few thousand points. Thinned-out lines are not even parsed, except one whose loss is not
finite: that one is kept off the stride too (the first cap/2 of them: where the run
diverged). Windows of per-rank figures, validations and events (start, resume, end) are few
and all kept.

A job that restarts from a checkpoint at step S does again the steps after S: what was
recorded of them before the restart is dropped when the restart's start line arrives, so
the curves go on from the checkpoint, with the restart marked there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

import numpy as np

from shoal.dashboard import records
from shoal.dashboard.tail import LineTail

METRICS = "metrics.jsonl"
STEP_PREFIX = b'{"type": "step"'
WINDOW_PREFIX = b'{"type": "ranks"'
NONFINITE_LOSS = b'"loss": null'
NEWLINE = ord("\n")


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
        self._off_stride = 0  # points kept off the stride for a non-finite loss
        self.windows: list[dict] = []  # 'ranks' records: every rank's figures per window
        self.validation: list[dict] = []
        self.events: list[dict] = []
        self.bad_lines = 0  # lines read that records.parse refuses (thinned-out ones are not read)
        self.last_growth = time.time()  # when new bytes last arrived
        self.last_step: int | None = None

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].get("kind") == "end"

    def poll(self) -> dict | None:
        """Read what was appended; returns the new records (None: nothing new)."""
        new: dict = {"points": [], "windows": [], "validation": [], "events": []}
        before = (self.stride, self.window_stride)
        skipped = self.tail.skipped
        for block in self.tail.blocks():
            self._take_block(block, new)
        self.bad_lines += self.tail.skipped - skipped  # lines too long to be records
        if self.tail.replaced:  # the file was started anew: so is everything known of it
            self.tail.replaced = False
            name = self.name
            # ignore: mypy refuses __init__ on an instance (a subclass's could differ)
            self.__init__(self.dir, self.index, self.cap, self.window_cap)  # type: ignore[misc]
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

    def _take_block(self, block: memoryview, new: dict) -> None:
        # A million-line file comes through here 16 MB at a time. Which lines are steps is
        # found for all of them at once (numpy); one by one are looked at only the step
        # lines that are kept and the lines of other kinds (a few per hundred).
        data = np.frombuffer(block, np.uint8)
        if not len(data):
            return
        ends = np.flatnonzero(data == NEWLINE)
        starts = np.concatenate(([0], ends + 1))
        ends = np.append(ends, len(data))
        is_step = ends - starts >= len(STEP_PREFIX)
        for k, byte in enumerate(STEP_PREFIX):
            is_step &= data[np.minimum(starts + k, len(data) - 1)] == byte
        others = np.flatnonzero(~is_step).tolist() + [len(starts)]
        # Step lines with a loss that is not finite are kept whatever the stride.
        marked = np.searchsorted(starts, _find_all(block, NONFINITE_LOSS), side="right") - 1
        flagged = sorted({i for i in marked.tolist() if is_step[i]})
        seen, line, f = self.seen_steps, 0, 0
        for other in others:
            # Lines line..other-1 are the step lines numbered seen+1..last.
            first, last, number = seen + 1 - line, seen + other - line, seen
            while True:
                due = (number // self.stride + 1) * self.stride
                while f < len(flagged) and flagged[f] + first <= number:
                    f += 1
                if f < len(flagged) and flagged[f] < other:
                    due = min(due, flagged[f] + first)
                if due > last:
                    break
                i = due - first
                self.seen_steps = number = due
                self._take_step(bytes(block[starts[i]:ends[i]]), new)  # may double the stride
            self.seen_steps = seen = last
            if other < len(starts):
                self._take(bytes(block[starts[other]:ends[other]]), new)
            line = other + 1

    def _take_step(self, line: bytes, new: dict) -> None:
        record = self._parse(line)
        if record is None:
            return
        if record["type"] != "step":  # '{"type": "step", ..., "type": "ranks"}'
            self.bad_lines += 1
            return
        self.last_step = record.get("step", self.last_step)
        off_stride = self.seen_steps % self.stride != 0  # taken for its non-finite loss
        if off_stride and self._off_stride >= self.cap // 2:
            return  # where a run diverged is shown by the first ones
        self.points.append(record)
        self._numbers.append(self.seen_steps)
        self._off_stride += off_stride
        new["points"].append(record)
        if len(self.points) > self.cap:
            self._thin(self.stride * 2)

    def _thin(self, stride: int) -> None:
        """Keep the points on ``stride``, and the first cap/2 others with a non-finite
        loss (never more: a run whose loss stays NaN would double the stride at every
        step)."""
        self.stride, kept, self._off_stride = stride, [], 0
        for i, (p, n) in enumerate(zip(self.points, self._numbers, strict=True)):
            if n % stride == 0:
                kept.append(i)
            elif p.get("loss", 0) is None and self._off_stride < self.cap // 2:
                kept.append(i)
                self._off_stride += 1
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
                    self._off_stride = sum(n % self.stride != 0 for n in self._numbers)
                setattr(self, name, kept)
                new[name] = list(kept)
                new.setdefault("replace", []).append(name)

    def _parse(self, line: bytes) -> dict | None:
        record = records.parse(line)
        self.bad_lines += record is None
        return record

    def snapshot(self) -> dict:
        return {"id": self.index, "name": self.name, "dir": str(self.dir),
                "points": self.points, "windows": self.windows,
                "validation": self.validation, "events": self.events,
                "stride": [self.stride, self.window_stride], "bad_lines": self.bad_lines}


def _find_all(block: memoryview, text: bytes) -> list[int]:
    """Where ``text`` is in ``block``, a view from the start of a buffer (bytes.find is the
    fastest search, and needs the buffer itself)."""
    buffer, found = cast("bytearray", block.obj), []  # LineTail's views are of a bytearray
    at = buffer.find(text, 0, len(block))
    while at >= 0:
        found.append(at)
        at = buffer.find(text, at + 1, len(block))
    return found
