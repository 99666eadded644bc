"""Helpers for tests: run the CLI, compare tensors, find leftover processes."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_shoal(*args: str, cwd: str | None = None, timeout: float = 120,
              env: dict | None = None, fork: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m shoal ARGS`` and capture its output.

    ``fork``: started by this test process's zygote (tests.zygote: forked from a process that
    has imported torch, which saves about 1.3 s of CPU a start) where there is one (Linux,
    and SHOAL_TEST_FORK is not 0), else as a new interpreter."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if fork and sys.platform == "linux" and os.environ.get("SHOAL_TEST_FORK") != "0":
        return _zygote().run(list(args), cwd or REPO, full_env, timeout)
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


class _Zygote:
    """The client of tests.zygote: started once per test process, on first use."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="shoal-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        assert ready == b"ready\n", f"the test zygote did not start: {ready!r}"
        atexit.register(self.close)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, argv: list[str], cwd: str, env: dict, timeout: float
            ) -> subprocess.CompletedProcess:
        """As ``subprocess.run(capture_output=True, text=True, timeout=timeout)``."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
            socket.send_fds(conn, [request], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        replies, chunks = b"", {out_r: [], err_r: []}
        deadline = time.monotonic() + timeout
        pid = None
        with selectors.DefaultSelector() as selector:
            selector.register(out_r, selectors.EVENT_READ)
            selector.register(err_r, selectors.EVENT_READ)
            selector.register(conn, selectors.EVENT_READ)
            while len(selector.get_map()) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in selector.select(left):
                    data = (conn.recv(4096) if key.fileobj is conn
                            else os.read(key.fd, 1 << 16))
                    if not data:
                        selector.unregister(key.fileobj)
                    elif key.fileobj is conn:
                        replies += data
                    else:
                        chunks[key.fd].append(data)
                    if pid is None and b"\n" in replies:
                        pid = int(replies.split(b"\n")[0])
        lines = replies.split(b"\n")
        os.close(out_r)
        os.close(err_r)
        conn.close()
        stdout, stderr = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
        command = ["python", "-m", "shoal", *argv]
        if len(lines) < 3:  # no exit status: the deadline passed
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, int(lines[1]), stdout, stderr)


_zygotes: dict[int, _Zygote] = {}
_zygote_lock = threading.Lock()


def _zygote() -> _Zygote:
    with _zygote_lock:  # tests start commands from threads too
        if os.getpid() not in _zygotes:
            _zygotes[os.getpid()] = _Zygote()
        return _zygotes[os.getpid()]


def run_shoal_in_process(*args: str) -> subprocess.CompletedProcess:
    """``shoal ARGS`` through the command's own ``main``, in this process, from the repository
    root: for input that must be refused before anything starts, without paying for a
    process start per case. (Tests that run the real command prove that nothing else
    reaches the terminal.)"""
    from shoal.cli.main import main

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse refuses a flag this way
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(["shoal", *args], code, out.getvalue(), err.getvalue())


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``marker`` (zombies excluded)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
                    marker in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|a-b| / max|b|."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        scale = b[key].abs().max().clamp(min=1e-12)
        worst = max(worst, ((a[key] - b[key]).abs().max() / scale).item())
    return worst


def states_equal(a, b) -> bool:
    """Nested states (dicts, lists, tensors, numbers) equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b
