"""Worker bootstrap: runs the user's script or module exactly as ``python`` would.

The launcher starts ``python -m shoal.launch.worker [-m] ENTRY ARGS...``. Running the user's
code under torch's ``record`` writes any uncaught exception with its traceback to the error
file torch.distributed.elastic gives each worker, so the launcher can report it by rank.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import runpy
import signal
import sys
import traceback

from shoal.launch.frames import OWN_FRAMES

_PR_SET_PDEATHSIG = 1


def _is_own_frame(filename: str) -> bool:
    return any(part in filename.replace(os.sep, "/") for part in OWN_FRAMES)


def _user_traceback(tb):
    while tb is not None and _is_own_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _die_with_launcher() -> None:
    # If the launcher itself is killed (SIGKILL cannot be caught), no worker may outlive it.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the elastic agent's own shutdown still applies
    if os.getppid() == 1:
        os._exit(1)  # the launcher died before prctl took effect


def _run(argv: list[str]) -> dict:
    """Run the script or module as __main__; return its global namespace."""
    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        return runpy.run_module(module, run_name="__main__", alter_sys=True)
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    return runpy.run_path(script, run_name="__main__")


def _shut_down(namespace: dict) -> None:
    """Free the script's objects, then its process group, while the interpreter is whole.

    A DDP model left in the script's globals keeps gloo's threads and buffers alive until
    interpreter finalization, where tearing them down aborts the process now and then
    ("terminate called without an active exception"): a finished job would read as failed.
    """
    namespace.clear()
    gc.collect()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    # Run in place of a scheduler's task (shoal.launch.direct), no launcher is the parent:
    # a parent of pid 1 (tini, a container's init) is then no sign of a dead launcher.
    if os.environ.pop("SHOAL_IN_PLACE", None) != "1":
        _die_with_launcher()
    # Worker output goes to files: line buffering keeps it live and loses nothing on exit.
    sys.stdout.reconfigure(line_buffering=True)
    from shoal.runtime import heartbeat

    heartbeat.enable_from_environment()
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

    try:
        # record() writes the error file that the launcher's failure summary reads.
        # record() turns sys.exit(0) into None: nothing left to shut down then but the group.
        _shut_down(record(_run)(sys.argv[1:]) or {})
    except SystemExit as exc:
        if exc.code not in (0, None):
            # Recorded so the launcher knows this rank chose to exit, even if it is stopped
            # while still shutting down (its exit code would then read as SIGTERM).
            ErrorHandler().record_exception(exc)
        raise
    except BaseException as exc:
        # Printed here rather than by sys.excepthook: torch's hook would add a second rank
        # prefix to lines the launcher already prefixes.
        traceback.print_exception(type(exc), exc, _user_traceback(exc.__traceback__))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _exit_now()


def _exit_now() -> None:
    """Exit 0 without the interpreter's finalization (atexit handlers still run).

    Even with the group destroyed, objects of torch's C++ side torn down by static
    destructors at finalization abort the process now and then ("terminate called without
    an active exception"), and a finished job reads as failed.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
