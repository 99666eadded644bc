"""A `shoal` command run in a forked copy of this process, not a new interpreter.

A launcher that starts launchers of its own (live mode's replica groups) has imported torch
already; each child forked from it skips that import (about 1.3 s of CPU a group here). The
child is what ``python -m shoal ARGV`` would be, as far as the command can tell: the given
environment, default signal handlers, this process's standard streams and working directory,
exit handlers run at the end. Settings that torch reads once when it is imported keep this
process's values, which are the child's own too: its environment is this one's, plus
variables that torch reads later (the replica group's place).

Used as the ``subprocess.Popen`` it replaces: ``pid``, ``returncode``, ``poll``, ``wait``,
``send_signal``, ``terminate``. POSIX only (``os.fork``).
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import traceback
from typing import NoReturn

from shoal.launch.forkserver import drop_server
from shoal.runtime.parent import die_with_parent


class ForkedCommand:
    """``shoal ARGV`` in a child forked now, with the environment ``env``, in the working
    folder ``cwd`` (None: this process's)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None = None):
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _become(argv, env, parent, cwd)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _become(argv: list[str], env: dict[str, str], parent: int, cwd: str | None) -> NoReturn:
    """In the child of ``parent``: run ``shoal ARGV`` and exit with its status; never
    returns."""
    code = 1
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # A launcher SIGKILLed leaves no group behind: each stops its workers as on a
        # SIGTERM (they save first, with a checkpoint_dir). (After the handlers above: the
        # parent's, inherited, would take that SIGTERM for one of its own.)
        die_with_parent(signal.SIGTERM, parent)
        os.environ.clear()
        os.environ.update(env)
        drop_server()  # its parent's: this command makes its own
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [sys.argv[0], *argv]
        runpy.run_module("shoal", run_name="__main__", alter_sys=True)  # python -m shoal
        code = 0
    except SystemExit as exc:  # the status the interpreter would make of it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing more can be said
                pass
        os._exit(code)
