"""Where a step's time goes on this rank: data, compute, communication, optimizer, other.

    data       waiting for the next batch (the DataLoader)
    compute    forward and backward, less the communication backward waited for
    comm       communication the step waited for: the gradient all-reduce's tail that
               backward could not hide, and blocking collectives (weight averaging)
    optimizer  the optimizer step (unscale, clipping, step, zero_grad), less blocking comm
    other      the rest of the step (LR scheduler, checkpoints, progress, ...)

The step time runs from the end of the previous step to the end of this one; the five
phases add up to it. On the CPU each mark reads the clock. On CUDA each mark records a CUDA
event on the current stream and the events are read when the metrics window closes, with
one wait for the device per window: the phases are the GPU's timeline, and the CPU runs
ahead of the GPU as it would without metrics.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple, cast

import torch

PHASES = ("data", "compute", "comm", "optimizer", "other")


class _Step(NamedTuple):
    start: object  # a perf_counter reading, or a recorded CUDA event (None: unmeasured)
    end: object  # (unmeasured: the step's wall time)
    laps: list[tuple[str, object, object]]  # (phase, from, to)
    comm_wait: float
    comm_blocked: float


class StepClock:
    """Marks phase boundaries on this rank; ``take`` returns one record per closed step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = self._last = self._stamp()
        self._laps: list[tuple[str, object, object]] = []
        self._steps: list[_Step] = []

    def _stamp(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: object, b: object) -> float:
        if self.cuda:
            return cast("torch.cuda.Event", a).elapsed_time(cast("torch.cuda.Event", b)) / 1e3
        return cast(float, b) - cast(float, a)

    def begin(self) -> None:
        """Start of an epoch: the first step's time counts from here."""
        self._start = self._last = self._stamp()
        self._laps = []

    def lap(self, phase: str) -> None:
        """The time since the previous mark was spent in ``phase`` ('data',
        'forward_backward' or 'optimizer')."""
        now = self._stamp()
        self._laps.append((phase, self._last, now))
        self._last = now

    def skip(self) -> None:
        """The time since the previous mark belongs to no phase ('other')."""
        self._last = self._stamp()

    def end_step(self, comm_wait: float, comm_blocked: float) -> None:
        """Close this step and start the next.

        ``comm_wait`` is all the communication waited for, ``comm_blocked`` the part of it
        spent in blocking collectives inside the optimizer phase.
        """
        end = self._stamp()
        self._steps.append(_Step(self._start, end, self._laps, comm_wait, comm_blocked))
        self._laps = []
        self._start = self._last = end

    def unmeasured(self, seconds: float) -> None:
        """A step closed elsewhere (another live group's, see ``StepMetrics.adopt``): its
        wall time, and no split of it (NaN phases). The step under way is not touched."""
        self._steps.append(_Step(None, seconds, [], math.nan, math.nan))

    def take(self) -> list[dict[str, float]]:
        """The phases in seconds, and 'step' (their sum), of every step closed since the
        last call; on CUDA this waits for the last one's kernels (once per window)."""
        steps, self._steps = self._steps, []
        measured = [step for step in steps if step.start is not None]
        if self.cuda and measured:
            cast("torch.cuda.Event", measured[-1].end).synchronize()
        return [self._record(step) for step in steps]

    def _record(self, step: _Step) -> dict[str, float]:
        if step.start is None:  # unmeasured: its end is its wall time
            return {**dict.fromkeys(PHASES, math.nan), "step": cast(float, step.end)}
        acc = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
        for phase, a, b in step.laps:
            acc[phase] += self._seconds(a, b)
        total = self._seconds(step.start, step.end)
        overlapped = max(0.0, step.comm_wait - step.comm_blocked)
        record = {
            "data": acc["data"],
            "compute": max(0.0, acc["forward_backward"] - overlapped),
            "comm": step.comm_wait,
            "optimizer": max(0.0, acc["optimizer"] - step.comm_blocked),
        }
        record["other"] = max(0.0, total - sum(record.values()))
        record["step"] = total
        return record
