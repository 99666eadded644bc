"""A public-style DDP script written for torchrun (only torch, ending with
``sys.exit(main())``), unmodified, under torchrun and under `shoal run` with the same
command line, in each of torchrun's launcher forms (a script path, ``-m`` with a module in
the working folder, c10d rendezvous with a port and without one, static rendezvous): the
same exit status, the same losses bit for bit, the same weights."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shoal.launch.config import DEFAULT_RDZV_PORT
from shoal.launch.ports import free_port
from tests.helpers import REPO, run_shoal, states_equal

SCRIPT = os.path.join(REPO, "tests", "launch", "ddp_example.py")
LOSS = re.compile(r"^(?:\[rank\d\]: )?(rank \d local \d epoch \d+ step \d+ loss \S+)$",
                  re.MULTILINE)
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _form(name: str, tmp_path) -> tuple[list[str], list[str] | None]:
    """The launcher flags and entry of form ``name`` (the same for both launchers), and
    for a form that needs a port, the other launcher's flags (each its own free port, so
    that both run at once); None where both must take turns (torchrun's default port)."""
    entry = [SCRIPT]
    if name == "module":  # as `cd DIR && torchrun -m ddp_example`
        shutil.copy(SCRIPT, tmp_path / "ddp_example.py")
        entry = ["-m", "ddp_example"]
    ports = (free_port(), free_port())
    flags = {
        "script": lambda port: [],
        "module": lambda port: [],
        "c10d": lambda port: ["--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
                              "--rdzv_id=forms"],
        "c10d-no-port": lambda port: ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost"],
        "static": lambda port: ["--nnodes=1", "--node_rank=0", "--rdzv_backend=static",
                                "--master_addr=127.0.0.1", f"--master_port={port}"],
    }[name]
    ours, theirs = ([*flags(port), "--nproc_per_node=2", *entry] for port in ports)
    return ours, None if name == "c10d-no-port" else theirs


@contextlib.contextmanager
def _default_port_turn():
    """One test of this suite at a time on torchrun's default c10d port."""
    path = os.path.join(tempfile.gettempdir(), f"shoal-tests-port-{DEFAULT_RDZV_PORT}")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _torchrun(flags: list[str], args: list[str], tmp_path, cwd: str):
    """torchrun's run, from up to 3 tries, and its per-rank logs. A worker under torchrun
    aborts now and then in gloo's teardown at interpreter exit, after its last line
    (SIGABRT, "terminate called without an active exception"; shoal's bootstrap frees the
    process group before the interpreter ends). torchrun's workers share its stdout, where
    their lines can mix: each rank's own output is read from its per-rank logs."""
    for attempt in range(3):
        logs = tmp_path / f"torchrun-logs-{attempt}"
        run = subprocess.run([TORCHRUN, f"--log_dir={logs}", "--redirects=3", *flags, *args,
                              "--out", str(tmp_path / "torchrun.pt")],
                             cwd=cwd, capture_output=True, text=True, timeout=150,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        if run.returncode == 0 or "SIGABRT" not in run.stderr:
            break
    return run, logs


@pytest.mark.timeout(4 * 150 + 30)  # up to 3 torchrun runs and shoal's
@pytest.mark.parametrize("form", ["script", "module", "c10d", "c10d-no-port", "static"])
def test_a_torchrun_script_runs_the_same_under_shoal(form, tmp_path):
    args = ["--epochs", "2", "--lr", "0.1"]
    ours, theirs = _form(form, tmp_path)
    cwd = str(tmp_path) if form == "module" else REPO

    def shoal():
        return run_shoal("run", *ours, *args, "--out", str(tmp_path / "shoal.pt"), cwd=cwd,
                         timeout=150)

    if theirs is None:  # both on torchrun's default port: one after the other
        with _default_port_turn():
            torchrun, logs = _torchrun(ours, args, tmp_path, cwd)
            shoal_run = shoal()
    else:  # they share nothing: side by side
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(shoal)
            torchrun, logs = _torchrun(theirs, args, tmp_path, cwd)
            shoal_run = running.result()
    assert torchrun.returncode == shoal_run.returncode == 0, (torchrun.stderr,
                                                              shoal_run.stderr)
    theirs_lines = [line for path in sorted(logs.rglob("stdout.log"))
                    for line in LOSS.findall(path.read_text())]
    ours_lines = LOSS.findall(shoal_run.stdout)
    assert len(theirs_lines) == 2 * 2 * 8  # ranks x epochs x steps
    assert sorted(ours_lines) == sorted(theirs_lines)
    # Each rank's own lines in the order it printed them.
    for rank in (0, 1):
        assert [x for x in ours_lines if x.startswith(f"rank {rank}")] == \
            [x for x in theirs_lines if x.startswith(f"rank {rank}")]
    assert states_equal(torch.load(tmp_path / "torchrun.pt", weights_only=True),
                        torch.load(tmp_path / "shoal.pt", weights_only=True))
