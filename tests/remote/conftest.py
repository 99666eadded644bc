"""A `shoal remote serve` process per test, on a free loopback port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO


class Server:
    """`python -m shoal remote serve` serving tests.remote.blocks:block; killed at the end."""

    def __init__(self, *flags: str, module: str = "tests.remote.blocks:block",
                 netns: str | None = None, host: str = "127.0.0.1"):
        self.flags, self.module, self.netns, self.host = list(flags), module, netns, host
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Server:
        """Start (again, on the same port once it has one)."""
        argv = [sys.executable, "-m", "shoal", "remote", "serve", "--module", self.module,
                "--host", self.host, "--port", str(self.port), "--threads", "1", *self.flags]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
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
        started.append(Server(*flags, **kwargs))
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
