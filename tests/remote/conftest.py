"""A `shoal remote serve` process per test, on a free loopback port."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from shoal.launch.forkserver import STEP_SIGNALS, start_method
from tests.helpers import REPO


def _serve_in_child(argv: list[str], env: dict[str, str], out, err) -> None:
    """`shoal remote serve ARGV` in a process forked from shoal's preloaded server, its
    stdout and stderr on the pipes ``out`` and ``err``, as if started by ``python -m shoal``."""
    import setproctitle

    from shoal.cli.main import main

    setproctitle.setproctitle(" ".join(["python -m shoal", *argv]))  # for ps, as started
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    for signum in STEP_SIGNALS:  # the preloaded server ignores them; a server does not
        signal.signal(signum, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    sys.exit(main(argv))


class _Forked:
    """The few things of a ``subprocess.Popen`` that the tests use, for a process forked from
    shoal's preloaded server (a start without importing torch again: ~2 s of CPU less)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        context = multiprocessing.get_context(start_method())
        out_r, out_w = context.Pipe(duplex=False)
        err_r, err_w = context.Pipe(duplex=False)
        self._process = context.Process(target=_serve_in_child, args=(argv, env, out_w, err_w),
                                        daemon=True)
        self._process.start()
        out_w.close()
        err_w.close()
        self.pid = self._process.pid
        self.stdout = open(os.dup(out_r.fileno()), encoding="utf-8")
        self.stderr = open(os.dup(err_r.fileno()), encoding="utf-8")
        out_r.close()
        err_r.close()

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["shoal", "remote", "serve"], timeout)
        return self._process.exitcode


class Server:
    """`shoal remote serve` serving tests.remote.blocks:block; killed at the end. ``forked``:
    forked from shoal's preloaded server instead of a new ``python -m shoal`` process."""

    def __init__(self, *flags: str, module: str = "tests.remote.blocks:block",
                 netns: str | None = None, host: str = "127.0.0.1", forked: bool = False):
        self.flags, self.module, self.netns, self.host = list(flags), module, netns, host
        self.forked = forked and netns is None
        self.port = 0
        self.proc: subprocess.Popen | _Forked | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Server:
        """Start (again, on the same port once it has one)."""
        argv = ["remote", "serve", "--module", self.module, "--host", self.host, "--port",
                str(self.port), "--threads", "1", *self.flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if self.forked:
            self.proc = _Forked(argv, env)
        else:
            argv = [sys.executable, "-m", "shoal", *argv]
            if self.netns:
                argv = ["ip", "netns", "exec", self.netns, *argv]
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        found = re.search(r" at \S+:(\d+) ", line)
        if not found:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"the server did not start: {line}{self.proc.stderr.read()}")
        self.port = int(found.group(1))
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def serve():
    """``serve(*flags, module=...)``: a started server; all are killed after the test."""
    started: list[Server] = []

    def make(*flags: str, **kwargs) -> Server:
        started.append(Server(*flags, forked=True, **kwargs))
        return started[-1]
    yield make
    for server in started:
        server.close()


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
