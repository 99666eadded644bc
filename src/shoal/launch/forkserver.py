"""The server that shoal.spawn and `shoal run` fork their worker processes from (Linux).

The server (Python's "forkserver" start method) imports torch and torch._dynamo (every
optimizer imports it) once, and lives as long as the process that started it: a process
forked from it starts in a fraction of a second instead of importing torch again (about 4 s
of CPU each on a small machine).

A forked process starts with the server's environment, which is its starter's as it was
when the server started; ``in_callers_environment`` gives it the environment its caller
passes, with what torch.distributed.elastic set for it on top. Settings that torch reads
once when it is imported (e.g. TORCH_COMPILE_DISABLE) stay as they were when the server
started.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

# shoal.training.trainer: what a training script imports next (over 1 s here).
PRELOAD = ["shoal.launch.forkserver_start", "torch", "torch._dynamo", "shoal.launch.forkserver",
           "shoal.launch.worker", "shoal.training.trainer"]
# What a scheduler sends every process of a job step; the server ignores them
# (shoal.launch.forkserver_start) and the processes forked from it handle them as usual.
STEP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
# What torch.distributed.elastic sets for each worker it starts from a function.
ELASTIC_KEYS = frozenset({
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"})
_SERVER_ENV = dict(os.environ)  # in a forkserver's children: the server's environment
_IMPORTED_BY = os.getpid()


def start_method() -> str:
    """"forkserver" where processes can be forked from the preloaded server, else "spawn"."""
    # Linux only: on macOS, forking a process that has imported torch is unsafe.
    if sys.platform != "linux" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Not the caller's __main__: from Python 3.13.8 on a server would run the caller's
    # script, before torch and with the first call's environment. A server that is already
    # running keeps what it has preloaded.
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def start_server() -> None:
    """Start the server now (it imports ``PRELOAD`` in the background), unless it runs."""
    from multiprocessing import forkserver

    start_method()
    forkserver.ensure_running()


def forget_ended_server() -> tuple[int, str] | None:
    """If the server this process started has ended, forget it, so that the next process
    started makes a new one; its pid and how it ended ("was killed by SIGKILL"), else None.

    Python's own check (``ensure_running``) makes a new server only when the old one has
    ended before it looks, and then silently; one that ends while it forks breaks the start
    off. This lets the launcher look first, and say so.
    """
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # typeshed declares none of its private fields
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        ended, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped already
        ended, status = pid, 0
    if not ended:
        return None
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    if os.WIFSIGNALED(status):
        return pid, f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return pid, f"ended with status {os.waitstatus_to_exitcode(status)}"


def in_callers_environment(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in the environment ``env`` of the caller (of shoal.spawn, or the
    launcher), plus what torch.distributed.elastic set for this process (RANK, ...)."""
    ours = {k: v for k, v in os.environ.items() if k in ELASTIC_KEYS}
    if _IMPORTED_BY != os.getpid():
        # Forked from a server that preloaded this module: what differs from the server's
        # environment was set by elastic too.
        ours.update({k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v})
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(ours)
    for signum in STEP_SIGNALS:  # the server ignores them; this process does not
        signal.signal(signum, signal.SIG_DFL)
    return fn(*args)
