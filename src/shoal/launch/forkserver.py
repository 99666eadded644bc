"""The server that shoal.spawn and `shoal run` fork their worker processes from (Linux).

The server (Python's "forkserver" start method) imports torch and torch._dynamo (every
optimizer imports it) once, and lives as long as the process that started it: a process
forked from it starts in a fraction of a second instead of importing torch again (about 4 s
of CPU each on a small machine). The launcher of `shoal run`, `shoal train` and `shoal rl`
makes its server by forking itself as it starts (``fork_server_now``), before anything of
the user's is imported: a copy of a process that has imported torch needs only the rest
(measured: a digits job of 2 workers, 4.4 s of CPU to start and train 20 steps with a server
Python starts, 3.3 s with a forked one).

A forked process starts with the server's environment, which is its starter's as it was
when the server started; ``in_callers_environment`` gives it the environment its caller
passes, with what torch.distributed.elastic set for it on top. Settings that torch reads
once when it is imported (e.g. TORCH_COMPILE_DISABLE) stay as they were when the server
started.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

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
_wake_fd: int | None = None  # the write end that wakes a server fork_server_now made


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
    """Start the server now (it imports ``PRELOAD`` in the background), unless it runs;
    wake the one ``fork_server_now`` made."""
    global _wake_fd
    from multiprocessing import forkserver

    start_method()
    forkserver.ensure_running()
    if _wake_fd is not None:
        with contextlib.suppress(OSError):  # it has ended: the next start replaces it
            os.write(_wake_fd, b"!")
        os.close(_wake_fd)
        _wake_fd = None


def fork_server_now() -> bool:
    """Fork this process now into the server of every process it starts later by
    "forkserver"; the server waits, idle, until the first of them (or ``start_server``), then
    imports ``PRELOAD`` and serves as Python's own does. Returns whether it was forked.

    A server Python starts is a new interpreter, which imports torch again (about 1.3 s of
    CPU here, half the server's start); a copy of a process that has imported torch does
    not. Call it where nothing else runs in this process (no thread but the main one): the
    copy has only the calling thread. Not forked where this Python's server differs from
    the one this knows (``_fork_capable``), where a server runs already, or where processes
    are not started by "forkserver" here; the next start then makes one as Python does.
    """
    global _wake_fd
    from multiprocessing import connection, forkserver, util

    server: Any = forkserver._forkserver
    if start_method() != "forkserver" or not _fork_capable(server) or \
            server._forkserver_pid is not None:
        return False
    with server._lock:
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every process that uses the server holds the "alive" pipe's write end; the server
        # ends when they all have ended. The "wake" pipe: start_server asks it to preload.
        alive_r, alive_w = os.pipe()
        wake_r, wake_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            stream.flush()
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            os.close(wake_w)
            _serve_when_woken(listener, alive_r, wake_r)
        listener.close()
        os.close(alive_r)
        os.close(wake_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
        _wake_fd = wake_w
    return True


def _fork_capable(server: Any) -> bool:
    """Whether Python's server is the one ``fork_server_now`` knows how to stand in for: its
    ``main`` takes these arguments and no more (a Python whose server checks an
    authentication key is left to start its own), and its state has these fields."""
    from multiprocessing import forkserver

    try:
        names = list(inspect.signature(forkserver.main).parameters)
    except (TypeError, ValueError):
        return False
    return names == ["listener_fd", "alive_r", "preload", "main_path", "sys_path"] and all(
        hasattr(server, field) for field in (
            "_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid",
            "_preload_modules"))


def _serve_when_woken(listener: socket.socket, alive_r: int, wake_r: int) -> NoReturn:
    """In the forked server: wait for the first process to start (or a wake-up), then serve
    as Python's server; end when the processes that use it have ended. Never returns."""
    global _SERVER_ENV
    from multiprocessing import forkserver

    code = 1
    try:
        _SERVER_ENV = dict(os.environ)  # what this server's children start with
        keep = sorted({0, 1, 2, listener.fileno(), alive_r, wake_r})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
            os.closerange(low + 1, high)  # nothing of the starter's but the terminal
        become_server_process()

        ready = select.select([listener.fileno(), alive_r, wake_r], [], [])[0]
        # Not woken by its starter ending or giving it up (its ends of both pipes close).
        woken = listener.fileno() in ready or (wake_r in ready and os.read(wake_r, 1) != b"")
        if woken and alive_r not in ready:
            os.close(wake_r)
            server: Any = forkserver._forkserver
            forkserver.main(listener.detach(), alive_r, server._preload_modules)
        code = 0
    except SystemExit:  # the processes it served have ended
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def become_server_process() -> None:
    """What makes this process the workers' server in ``ps`` and to a scheduler's signals
    (shoal.launch.forkserver_start)."""
    import setproctitle

    for signum in STEP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    setproctitle.setproctitle(f"shoal forkserver (serves pid {os.getppid()})")


def drop_server() -> None:
    """Give up the server this process holds (one ``fork_server_now`` made, or one inherited
    by forking a process that holds one): a server nothing else holds ends, and the next
    process started makes a new one."""
    global _wake_fd
    from multiprocessing import forkserver

    if _wake_fd is not None:
        os.close(_wake_fd)
        _wake_fd = None
    _forget(forkserver._forkserver)


def _forget(server: Any) -> None:
    """Close this process's end of ``server``'s "alive" pipe and forget the server."""
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


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
    _forget(server)
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
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # Read by torch when it is imported, which the server did with its own environment.
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
    return fn(*args)
