"""Worker bootstrap: runs the user's script or module exactly as ``python`` would.

The launcher starts ``python -m shoal.launch.worker [-m] ENTRY ARGS...``, or on Linux forks
the worker from a server that has imported torch and calls ``run_forked`` (see
shoal.launch.preload). Running the user's
code under torch's ``record`` writes any uncaught exception with its traceback to the error
file torch.distributed.elastic gives each worker, so the launcher can report it by rank.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import runpy
import signal
import sys
import time

from shoal.launch.frames import OWN_FRAMES, PID_FILE, peer_lost
from shoal.runtime import held_groups
from shoal.runtime.parent import die_with_parent, launcher_pid

TYPE_CHECKING = False  # typing is not imported: the worker pays for every import
if TYPE_CHECKING:
    from typing import Any

if __name__ != "__main__":
    import setproctitle

    # setproctitle finds the command line it rewrites through the environment, which a
    # forked worker has changed by the time it names itself; done here, in the server that
    # preloads this module, it is found before. (A worker started as a command needs none.)
    setproctitle.getproctitle()

_PEER_WAIT_S = 2.0  # many times the agent's monitor interval


def _is_own_frame(filename: str) -> bool:
    return any(part in filename.replace(os.sep, "/") for part in OWN_FRAMES)


def _user_traceback(tb):
    while tb is not None and _is_own_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _run(argv: list[str]) -> dict:
    """Run the script or module as __main__; return its global namespace."""
    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        return runpy.run_module(module, run_name="__main__", alter_sys=True)
    script, args = argv[0], argv[1:]
    # As `python SCRIPT`: sys.argv[0] as given, __file__ and tracebacks absolute.
    sys.argv = [script, *args]
    path = os.path.abspath(script)
    sys.path[0] = os.path.dirname(path)
    if os.path.isdir(path):  # a folder with a __main__.py: runpy's to run
        return runpy.run_path(script, run_name="__main__")
    with open(path, "rb") as f:
        source = f.read()
    if b"\0" in source:  # a zip of a __main__.py, as a folder
        return runpy.run_path(script, run_name="__main__")
    return _run_source(source, path)


def _run_source(source: bytes, path: str) -> dict:
    """Run a script's source as ``python`` does: in a ``__main__`` module of its own whose
    ``__file__`` is ``path``, ``sys.argv`` left as it is (runpy.run_path would put the path
    in ``sys.argv[0]``). Like runpy, ``sys.modules['__main__']`` is put back after, and a
    copy of the globals returned."""
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = SourceFileLoader("__main__", path)
    main.__dict__.update(__cached__=None, __builtins__=builtins)
    code = compile(source, path, "exec", dont_inherit=True)
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous
    return main.__dict__.copy()


def _shut_down(namespace: dict) -> None:
    """Free the script's objects, then its process group, while the interpreter is whole.

    A DDP model left in the script's globals keeps gloo's threads and buffers alive until
    interpreter finalization, where tearing them down aborts the process now and then
    ("terminate called without an active exception"): a finished job would read as failed.
    The process groups destroyed, by the script or here, are let go last
    (shoal.runtime.held_groups: freed by a DDP model, one could hang the worker).
    """
    namespace.clear()
    gc.collect()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    held_groups.let_go()


def _leave_pid() -> None:
    """This worker's pid and rank beside its error file, for the launcher's failure summary
    and its output relay."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(os.path.join(os.path.dirname(error_file), PID_FILE), "w") as f:
                f.write(f"{os.getpid()} {os.environ.get('RANK', '')}")
        except OSError:
            pass  # the summary then names the rank without its pid


def _record(exc: BaseException) -> None:
    """Write ``exc`` to the error file the launcher's failure summary reads, in the layout
    torch's ErrorHandler writes and torch's launcher reads.

    Written whole or not at all (a temporary file, then renamed): a rank that fails while
    the agent is stopping the others can be killed mid-write, and torch's agent, reading an
    empty error file, stops with a JSONDecodeError instead of reporting the failure (seen
    once under load, with every rank raising at once). Written here also when torch is
    imported, whose ErrorHandler writes in place; a script that never imported torch is not
    made to pay for that import (over a second) to report its failure.
    """
    import json
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "timestamp": str(int(time.time()))}}}
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(record, f)
        os.replace(partial, path)
    except OSError:
        pass  # the launcher then tells the failure by the exit status


def exit_status(exc: SystemExit) -> int:
    """The status ``python`` exits with for ``exc``, printing a non-number code as it does:
    None is 0, a number is itself, anything else is printed to stderr and is 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # what the parent reads, as for exit(3) in C
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script
            pass


def _bootstrap(argv: list[str], forked: bool = False) -> int:
    """Run the user's code and its atexit handlers; return the status ``python`` would exit
    with. An uncaught exception ends the process here (status 1, or the signal of a
    KeyboardInterrupt, as ``python`` does)."""
    # Run in place of a scheduler's task (shoal.launch.direct), no launcher is the parent:
    # a parent of pid 1 (tini, a container's init) is then no sign of a dead launcher. A
    # worker started as a command compares its parent with its launcher's pid (which is 1
    # where the launcher is a container's first process); a forked one's is the server.
    if os.environ.pop("SHOAL_IN_PLACE", None) != "1":
        die_with_parent(parent=None if forked else launcher_pid())  # none outlives it
    # Worker output goes to files: line buffering keeps it live and loses nothing on exit.
    # (typeshed types sys.stdout as a TextIO, which has no reconfigure: it is a TextIOWrapper)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    from shoal.runtime import heartbeat

    heartbeat.enable_from_environment()
    held_groups.hold_destroyed_groups()
    _leave_pid()
    # What torch's record() does first: a crash in C code prints every thread's stack.
    faulthandler.enable(all_threads=True)
    status = 0
    try:
        namespace = _run(argv)
    except SystemExit as exc:
        # sys.exit(), exit(), raise SystemExit: the script ends as python ends it.
        status = exit_status(exc)
        if status != 0:
            # Recorded so the launcher knows this rank chose to exit, even if it is stopped
            # while still shutting down (its exit code would then read as SIGTERM).
            _record(exc)
        exc.__traceback__ = None  # its frames hold the script's globals
        namespace = {}
    except BaseException as exc:
        _record(exc)
        _tell(exc)
        _flush()
        if forked:
            _let_the_peer_be_seen_first(exc)
        if isinstance(exc, KeyboardInterrupt):  # python ends by the signal itself
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(1)
    if status == 0:
        _shut_down(namespace)
        _say_if_trained_apart()
    atexit._run_exitfuncs()
    _flush()
    return status


def _tell(exc: BaseException) -> None:
    """Show the error that ends this rank: its traceback, or one line where a collective of
    torch.distributed lost its connection to a rank that failed (shoal's failure summary
    names the rank that failed first), or where a live session says why it cannot go on
    (its message says all). The traceback stays in the error file, for the summary."""
    import traceback

    # (not an OSError: a broken pipe or a reset connection of the script's own, a download)
    lost = peer_lost(f"{type(exc).__name__}: {exc}") if (
        "torch.distributed" in sys.modules and not isinstance(exc, OSError)) else None
    step = sys.modules.get("shoal.ft.step")  # (imported where a live session ran)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and os.path.exists(error_file):
        if lost is not None:
            print(f"shoal: lost its connection to a failed rank ({lost}): this rank stops "
                  "too (its stack is in its error file)", file=sys.stderr, flush=True)
            return
        if step is not None and isinstance(exc, step.LiveError):
            print(f"shoal: {exc}", file=sys.stderr, flush=True)
            return
    # Printed here rather than by sys.excepthook: torch's hook would add a second rank
    # prefix to lines the launcher already prefixes.
    traceback.print_exception(type(exc), exc, _user_traceback(exc.__traceback__))


def _say_if_trained_apart() -> None:
    """A live job's script that ended well without opening a live session (one that sets up
    torch.distributed itself): each replica group was a job of its own, and none heard of
    the others. Said once, by group 0's first rank."""
    # (shoal.ft.config's ENV_GROUP and ENV_OPENED: not imported where the job is not live)
    if "SHOAL_FT_GROUP" not in os.environ or os.environ.get("SHOAL_FT_OPENED"):
        return
    from shoal.ft.config import ReplicaPlace

    place = ReplicaPlace.from_environ()
    if place is None or place.group != 0 or os.environ.get("RANK", "0") != "0":
        return
    print(f"shoal: the script ended without meeting the other replica groups (shoal.Trainer "
          f"meets them at each step): its {place.groups} replica groups trained apart, each "
          "a job of its own. A script that sets up torch.distributed itself has no live "
          "recovery: run it without --replica-groups", file=sys.stderr, flush=True)


def main() -> None:
    """``python -m shoal.launch.worker [-m] ENTRY ARGS...``: a worker started as a command."""
    # Exit without the interpreter's finalization: even with the group destroyed, objects
    # of torch's C++ side torn down by static destructors at finalization abort the process
    # now and then ("terminate called without an active exception"), and a finished job
    # reads as failed.
    os._exit(_bootstrap(sys.argv[1:]))


def _let_the_server_go() -> None:
    """Close this process's handle on the forkserver, inherited so that it could start
    processes of its own there: with it open, the server outlives a killed launcher, and so
    do the workers, whose parent (the server) must die for them to get PDEATHSIG."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # typeshed declares none of its private fields
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    # The next use from here starts a server of this process's own.
    server._forkserver_alive_fd = server._forkserver_address = None


def _let_the_peer_be_seen_first(exc: BaseException) -> None:
    """A rank that failed only because a peer died waits a moment before it exits.

    torch's agent reports only the first forked worker it finds ended (a worker started as
    a command, it reports with every other one that ended by then): without the wait, the
    rank that lost its peer could be named in place of the peer killed first. The error is
    recorded already; the agent stops this rank when it has seen the peer.
    """
    if peer_lost(str(exc)) is not None:
        # The agent's SIGTERM ends the wait: a handler the job set (a checkpoint at the next
        # step, on preemption) has no step left to save at.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(_PEER_WAIT_S)


def run_forked(cwd: str, *argv: str) -> None:
    """The same bootstrap in a worker forked from the launcher's preloaded server
    (shoal.launch.worker_start), called by torch.distributed.elastic as a function.

    Returning hands elastic the (empty) result, which is how it learns that the worker
    finished well: a status of 0 (``sys.exit()``, ``exit()``, ``raise SystemExit``) returns.
    multiprocessing then ends the process with ``os._exit``, without the interpreter's
    finalization, as ``main`` does. Any other status ends the process here, while its
    output still goes to the rank's log.
    """
    import setproctitle

    _let_the_server_go()
    # ps, top and kill by name see the worker as they would one started as a command, and
    # not as the server (whose command line it inherits).
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "shoal.launch.worker", *argv]))
    # A session of its own, as elastic gives a worker it starts as a command: a Ctrl-C in
    # the terminal reaches the launcher, which passes it on, and not the worker twice.
    os.setsid()
    # The server's directory and sys.path[0] are the launcher's; be where `python -m` is.
    os.chdir(cwd)
    sys.path[0] = cwd
    status = _bootstrap(list(argv), forked=True)
    if status != 0:
        os._exit(status)


if __name__ == "__main__":
    main()
