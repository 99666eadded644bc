"""Helpers for tests: run the CLI, compare tensors, find leftover processes."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import psutil
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_shoal(*args: str, cwd: str | None = None, timeout: float = 120,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m shoal ARGS`` and capture its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


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
