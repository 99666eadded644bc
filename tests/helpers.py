"""Helpers for tests: run the CLI, compare tensors, find leftover processes."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import psutil
import torch

from shoal.launch.worker_start import FORK_FIRST_ENV
from tests import zygote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORKED_FIRST = {FORK_FIRST_ENV: "1"}
"""``env`` of a `shoal run` of one of the tests' own jobs, where how a script starts is not
what the test checks: the first attempt's workers are forked from the preloaded server too,
as every later attempt's are (about 2 s of CPU less a worker). The tests of the launcher
itself start them as commands, as `shoal run` does for a user's script."""


def run_shoal(*args: str, cwd: str | None = None, timeout: float = 120,
              env: dict | None = None, fork: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m shoal ARGS`` and capture its output. ``env``: variables set on top of
    this process's (OMP_NUM_THREADS 1 unless given; None: unset).

    ``fork``: started by this test process's zygote (tests.zygote: forked from a process that
    has imported torch, which saves about 1.3 s of CPU a start) where there is one (Linux,
    and SHOAL_TEST_FORK is not 0), else as a new interpreter."""
    full_env = {k: v for k, v in {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}.items()
                if v is not None}
    command = [sys.executable, "-m", "shoal", *args]
    if not (fork and zygote.available()):
        return subprocess.run(command, cwd=cwd or REPO, capture_output=True, text=True,
                              timeout=timeout, env=full_env)
    process = zygote.start(list(args), cwd or REPO, full_env, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def popen_shoal(*args: str, cwd: str | None = None, env: dict | None = None,
                text: bool = False, stderr_to_stdout: bool = False
                ) -> subprocess.Popen | zygote.Forked:
    """Start ``python -m shoal ARGS`` with its stdout and stderr in pipes (or both in one);
    forked by the tests' zygote where there is one (run_shoal), else a new interpreter."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if zygote.available():
        return zygote.start(list(args), cwd or REPO, full_env, stderr_to_stdout, text)
    return subprocess.Popen([sys.executable, "-m", "shoal", *args], cwd=cwd or REPO,
                            env=full_env, text=text, bufsize=-1 if text else 0,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE)


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
