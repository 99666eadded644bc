"""Worker heartbeats for the launcher's hang watch.

Each rank owns a 24-byte file (time of the last beat, step, pid) in a directory the
launcher names in SHOAL_HEARTBEAT_DIR; it is memory-mapped, so a beat is a store in memory,
with no system call on the training path. The Trainer beats after every optimizer step;
a custom loop calls ``shoal.heartbeat(step)``. A rank arms the watch with its first beat.
While a rank waits on something with a deadline of its own (a live job's quorum or step
across replica groups), ``waiting()`` beats for it from a thread: such a rank is alive and
waiting, not hung, and a frozen process (SIGSTOP) beats nothing.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_FORMAT = "<dqq"  # time of the last beat, step (-1: not yet armed), pid
SIZE = struct.calcsize(_FORMAT)
STACK_SIGNAL = signal.SIGUSR2

_map: mmap.mmap | None = None
_stack_file = None


def beat_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.beat")


def stack_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.stack")


def read(path: str) -> tuple[float, int, int] | None:
    """(time of the last beat, step, pid) of one rank, or None before it started."""
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
    except OSError:
        return None
    return struct.unpack(_FORMAT, data) if len(data) == SIZE else None


_last_step = 0
_beaten = False  # a step was beaten: the watch is armed


def last_step() -> int:
    """The step this process last reported with ``heartbeat`` (0 before any)."""
    return _last_step


def enable_from_environment() -> None:
    """Called by the worker bootstrap: set up this rank's beat file and stack dumps."""
    global _map, _stack_file
    directory = os.environ.get("SHOAL_HEARTBEAT_DIR")
    if not directory or "RANK" not in os.environ:
        return
    rank = int(os.environ["RANK"])
    with open(beat_path(directory, rank), "wb") as f:
        f.write(struct.pack(_FORMAT, time.time(), -1, os.getpid()))
    fd = os.open(beat_path(directory, rank), os.O_RDWR)
    _map = mmap.mmap(fd, SIZE)
    os.close(fd)
    # On SIGUSR2 the interpreter writes every thread's stack, even while the main thread
    # waits inside a C++ collective.
    _stack_file = open(stack_path(directory, rank), "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)


def heartbeat(step: int) -> None:
    """Tell the launcher this rank made progress (reached ``step``). Cheap; the file is
    written only when launched by `shoal run`.

    Never raises.
    """
    global _last_step, _beaten
    _last_step, _beaten = step, True
    if _map is not None:
        _map[:SIZE] = struct.pack(_FORMAT, time.time(), step, os.getpid())


_waits = 0  # waits under way in this process (``waiting``)
_waiter: threading.Thread | None = None
_lock = threading.Lock()


@contextmanager
def waiting(interval: float = 1.0) -> Iterator[None]:
    """Beat every ``interval`` seconds (at the last step) while the block runs. Only for a
    wait that ends by itself: a beat says the rank is alive, whatever the wait does. It
    never arms the watch: before a rank's first step (imports, compiling) nothing beats."""
    global _waits, _waiter
    if _map is None:
        yield
        return
    with _lock:
        _waits += 1
        if _waiter is None:
            _waiter = threading.Thread(target=_beat_while_waiting, args=(interval,),
                                       daemon=True, name="shoal-heartbeat-wait")
            _waiter.start()
    try:
        if _beaten:
            heartbeat(_last_step)
        yield
    finally:
        with _lock:
            _waits -= 1


def _beat_while_waiting(interval: float) -> None:
    while True:
        time.sleep(interval)
        if _waits and _beaten:
            heartbeat(_last_step)
