"""A process that ends with the process that started it, also where that one is SIGKILLed
(which it cannot catch to stop its children): a worker, a replica group's launcher, the
lighthouse."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "SHOAL_LAUNCHER_PID"
"""The pid of the launcher that starts workers as commands (their parent)."""


def die_with_parent(signum: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send this process ``signum`` when its parent ends (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing), and end now where the parent is gone already:
    where this process's parent is no longer ``parent`` (its pid, read before this process
    started: it may be 1, a container's first process), or without ``parent`` is pid 1.
    Call it first thing in the child, and only from a child its parent started in its main
    thread (the signal comes when the thread that started it ends)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own shutdown still applies
    if (os.getppid() == 1) if parent is None else (os.getppid() != parent):
        os._exit(1)  # the parent died before prctl took effect


def launcher_pid() -> int | None:
    """The pid of the launcher this process was started by as a command, where it says."""
    value = os.environ.get(LAUNCHER_ENV, "")
    return int(value) if value.isdigit() else None
