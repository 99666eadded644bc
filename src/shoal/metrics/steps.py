"""Where a step's time goes on this rank: data, compute, communication, optimizer, other.

    data       waiting for the next batch (the DataLoader)
    compute    forward and backward, less the communication backward waited for
    comm       communication the step waited for: the gradient all-reduce's tail that
               backward could not hide, and blocking collectives (weight averaging)
    optimizer  the optimizer step (unscale, clipping, step, zero_grad), less blocking comm
    other      the rest of the step (LR scheduler, checkpoints, progress, ...)

The step time runs from the end of the previous step to the end of this one; the five
phases add up to it. On CUDA the clock waits for the device at each mark, so each phase
holds its own kernels (this costs some overlap; turn metrics off to avoid it).
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "compute", "comm", "optimizer", "other")


class StepClock:
    """Marks phase boundaries on this rank and yields one record per optimizer step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._acc = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
        self._step_start = self._last = 0.0

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self) -> None:
        """Start of an epoch: the first step's time counts from here."""
        self._step_start = self._last = self.now()

    def lap(self, phase: str) -> None:
        """The time since the previous mark was spent in ``phase``."""
        now = self.now()
        self._acc[phase] += now - self._last
        self._last = now

    def skip(self) -> None:
        """The time since the previous mark belongs to no phase ('other')."""
        self._last = self.now()

    def end_step(self, comm_wait: float, comm_blocked: float) -> dict[str, float]:
        """This step's phases in seconds, and 'step' (their sum); starts the next step.

        ``comm_wait`` is all the communication waited for, ``comm_blocked`` the part of it
        spent in blocking collectives inside the optimizer phase.
        """
        end = self.now()
        total = end - self._step_start
        acc = self._acc
        overlapped = max(0.0, comm_wait - comm_blocked)
        record = {
            "data": acc["data"],
            "compute": max(0.0, acc["forward_backward"] - overlapped),
            "comm": comm_wait,
            "optimizer": max(0.0, acc["optimizer"] - comm_blocked),
        }
        record["other"] = max(0.0, total - sum(record.values()))
        record["step"] = total
        self._acc = dict.fromkeys(acc, 0.0)
        self._step_start = self._last = end
        return record
