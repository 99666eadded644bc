"""Preemption: a signal only sets a flag; all ranks agree at a step boundary, save, and exit.

SIGTERM and SIGUSR1 (what SLURM sends before a job's time runs out, with --signal) are
handled while the Trainer fits with a checkpoint directory. Ranks agree through an
all-reduce started after each optimizer step and waited for after the next one, so the
check never blocks a step: the job stops at most two steps after the signal. The same
all-reduce carries rank 0's "a timed checkpoint is due", so all ranks save at one step.

A live job's rank that waits for the other replica groups (a quorum that may take minutes)
is not at a step boundary: there the signal raises ``Preempted`` at once (one that came
since the last step boundary, as the wait starts), and the Trainer saves the last committed
step and exits.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shoal.errors import Preempted

if TYPE_CHECKING:
    from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def exit_code(signum: int) -> int:
    """The documented exit code of a preempted worker and launcher: 128 + signal number."""
    return 128 + signum


class PreemptionWatch:
    """Catches the preemption signals and tells, at each step, whether all ranks stop."""

    def __init__(self, device: torch.device, waiting: Callable[[], bool] | None = None):
        """``waiting()``: whether the rank now waits for the other replica groups (then a
        signal raises ``Preempted`` at once)."""
        self.device = device
        self.received: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._waiting = waiting

    def start(self) -> None:
        """Catch the signals (only the main thread may install handlers)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def stop(self) -> None:
        """Finish the agreement in flight and give the signals back their old handlers."""
        self._settle()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def before_wait(self) -> None:
        """As the rank starts to wait for the other replica groups: a signal that came
        since the last step boundary raises ``Preempted`` now (the handler raises only
        during the wait)."""
        if self.received is not None:
            raise Preempted(self.received)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received = signum
        if self._waiting is not None and self._waiting():
            raise Preempted(signum)

    def _settle(self) -> tuple[int, int]:
        """Wait for the outstanding agreement: (largest signal any rank saw, save due)."""
        if self._pending is None:
            return 0, 0
        work, flags = self._pending
        self._pending = None
        work.wait()
        signum, due = flags.tolist()
        return int(signum), int(due)

    def poll(self, save_due: bool = False) -> tuple[int, bool]:
        """At a step boundary: (signal to stop for, whether to save now), agreed by all."""
        mine = [self.received or 0, int(save_due)]
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine[0], bool(mine[1])
        signum, due = self._settle()
        flags = torch.tensor(mine, device=self.device)
        self._pending = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), flags)
        return signum, bool(due)
