"""Worker heartbeats for the launcher's hang watch.

Each rank owns a 24-byte file (time of the last beat, step, pid) in a directory the
launcher names in SHOAL_HEARTBEAT_DIR; it is memory-mapped, so a beat is a store in memory,
with no system call on the training path. The Trainer beats after every optimizer step;
a custom loop calls ``shoal.heartbeat(step)``. A rank arms the watch with its first beat.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import time

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
    written only when launched by `shoal run`."""
    global _last_step
    _last_step = step
    if _map is not None:
        _map[:SIZE] = struct.pack(_FORMAT, time.time(), step, os.getpid())
