"""What a rank sends over the network and how long its step waits for it.

Counted where the communication is issued (the DDP communication hook, the weight
averaging), in the ring model that gloo and NCCL follow for large messages and that
nccl-tests use for bus bandwidth: an all-reduce of S bytes on W ranks sends 2(W-1)/W x S
bytes from each rank; an all-gather of S bytes from each rank sends (W-1) x S.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple


def all_reduce_bytes(nbytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world_size - 1) / world_size * nbytes


def all_gather_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-gather where every rank gives ``nbytes``."""
    return (world_size - 1) * nbytes


class StepComm(NamedTuple):
    """One step's communication on this rank."""

    bytes: float
    """Bytes sent."""
    wait: float
    """Seconds the step waited for communication, ``blocked`` included."""
    blocked: float
    """Seconds of that in blocking collectives (weight averaging)."""


class Traffic:
    """Per-step counters of bytes sent and time spent waiting on communication.

    Asynchronous collectives (gradient buckets) are marked ``launched`` and ``done``; the
    wait of a step is the time from the last launch to the last completion, the part of the
    communication that backward could not hide. Blocking collectives add their whole
    duration through ``blocking``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # completions are reported from communication threads
        self._bytes = 0.0
        self._blocked = 0.0
        self._last_launch: float | None = None
        self._last_done: float | None = None
        self.total_bytes = 0.0
        self.total_wait = 0.0
        self.steps = 0

    def sent(self, nbytes: float) -> None:
        with self._lock:
            self._bytes += nbytes

    def launched(self) -> None:
        self._last_launch = time.perf_counter()

    def done(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._last_done = now if self._last_done is None else max(self._last_done, now)

    def blocking(self, seconds: float) -> None:
        with self._lock:
            self._blocked += seconds

    def end_step(self, step: bool = True) -> StepComm:
        """What was sent and waited for since the previous call; called once per step, and
        with ``step=False`` for communication outside any step (a final synchronization)."""
        with self._lock:
            blocked = waited = self._blocked
            if self._last_launch is not None and self._last_done is not None:
                waited += max(0.0, self._last_done - self._last_launch)
            sent = self._bytes
            self._bytes, self._blocked = 0.0, 0.0
            self._last_launch = self._last_done = None
        self.total_bytes += sent
        self.total_wait += waited
        self.steps += int(step)
        return StepComm(sent, waited, blocked)
