"""Preemption: a signal only sets a flag; all ranks agree at a step boundary, save, and exit.

SIGTERM and SIGUSR1 (what SLURM sends before a job's time runs out, with --signal) are
handled while the Trainer fits with a checkpoint directory. Ranks agree through an
all-reduce started after each optimizer step and waited for after the next one, so the
check never blocks a step: the job stops at most two steps after the signal.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def exit_code(signum: int) -> int:
    """The documented exit code of a preempted worker and launcher: 128 + signal number."""
    return 128 + signum


class PreemptionWatch:
    """Catches the preemption signals and tells, at each step, whether all ranks stop."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self._settle()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received = signum

    def _settle(self) -> int:
        """Wait for the outstanding agreement; the largest signal number any rank saw."""
        if self._pending is None:
            return 0
        work, flag = self._pending
        self._pending = None
        work.wait()
        return int(flag.item())

    def should_stop(self) -> int:
        """At a step boundary: the signal to stop for (agreed by all ranks), or 0."""
        mine = self.received or 0
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        agreed = self._settle()
        if agreed:
            return agreed
        flag = torch.tensor([mine], device=self.device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return 0
