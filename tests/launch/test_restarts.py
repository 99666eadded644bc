"""What a restart says: a line for each failure the workers are restarted after, the list of
every attempt's first failure when the restarts run out, the same failures in a restarted
Trainer's metrics events; and a workers' server that is killed is replaced, the run going
on bitwise as after any restart."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from tests.helpers import REPO, processes_with, run_shoal, states_equal

JOB = "tests/checkpoint/job.py"

FLAKY = textwrap.dedent("""\
    import os, signal, sys
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), os.environ["RANK"]
    if attempt == 0 and rank == "1":
        raise RuntimeError("the first attempt fails on rank 1")
    if attempt == 1 and rank == "0":
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.timeout(120)
def test_every_attempt_s_first_failure_is_told(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    out = run_shoal("run", "--nproc-per-node", "2", "--max-restarts", "1", str(script))
    assert out.returncode == 128 + 9, out.stderr
    told = re.findall(r"^shoal: attempt .*$", out.stderr, re.MULTILINE)
    assert len(told) == 1, out.stderr
    assert re.fullmatch(r"shoal: attempt 1 of 2 failed: rank 1 raised RuntimeError: the first "
                        r"attempt fails on rank 1 \(pid [1-9]\d*\); restarting all workers "
                        r"\(0 restarts left\)", told[0]), told[0]
    summary = out.stderr[out.stderr.index("shoal: rank 0 failed first"):]
    assert "Every attempt failed (2 of 2); the first failure of each:" in summary
    assert re.search(r"\n  attempt 1: rank 1 raised RuntimeError: the first attempt fails on "
                     r"rank 1 \(pid [1-9]\d*\)\n  attempt 2: rank 0 killed by SIGKILL "
                     r"\(pid [1-9]\d*\)\n", summary), summary


@pytest.mark.timeout(170)
def test_a_restarted_trainer_writes_the_failure_to_its_events(tmp_path):
    metrics = tmp_path / "metrics"
    trainer = json.dumps({"metrics": {"dir": str(metrics), "tensorboard": False}})
    out = run_shoal("run", "--nproc-per-node", "2", "--max-restarts", "2", JOB, str(tmp_path),
                    "--steps", "8", "--kills", json.dumps([[1, 3, "step"], [0, 6, "step"]]),
                    "--trainer", trainer, timeout=160)
    assert out.returncode == 0, out.stderr[-3000:]
    told = re.findall(r"^shoal: attempt (\d) of 3 failed: rank (\d) killed by SIGKILL "
                      r"\(pid \d+\); restarting all workers", out.stderr, re.MULTILINE)
    assert told == [("1", "1"), ("2", "0")], out.stderr[-3000:]
    events = [json.loads(line) for line in (metrics / "metrics.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["type"] == "event" and e["kind"] == "failure"]
    assert [(e["attempt"], e["rank"], e["cause"], e["exit_code"]) for e in failures] == [
        (1, 1, "killed by SIGKILL", 137), (2, 0, "killed by SIGKILL", 137)]
    assert all(e["pid"] > 0 for e in failures)


def _server_with_workers(launcher: psutil.Process, workers: int) -> psutil.Process | None:
    """The launcher's workers' server, once all ``workers`` of a restart are forked from it
    and run (killed while it still forks one, the server breaks that start off: another
    path, with a message of its own)."""
    for child in launcher.children():
        try:
            if " ".join(child.cmdline()).startswith("shoal forkserver") and sum(
                    "shoal.launch.worker" in " ".join(c.cmdline())
                    for c in child.children()) >= workers:
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.timeout(90 + 150 + 30)  # the guards below; the reference runs beside them
def test_a_killed_workers_server_is_replaced_and_the_run_goes_on_bitwise(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    # The uninterrupted reference runs beside the killed run: they share nothing.
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_shoal, "run", "--nproc-per-node", "2", JOB, str(straight),
                                "--steps", "12", "--no-checkpoints", timeout=150)
        # The first attempt's workers are new processes; rank 1 kills itself after step 4, and
        # the second attempt's are forked from the server, which is then killed with them.
        # Their 8 steps of 1 s (a sleep: no part of the state) leave the kill time to land
        # while they train, also on a loaded machine (at 0.3 s a step, it once came late).
        launcher = subprocess.Popen(
            [sys.executable, "-m", "shoal", "run", "--nproc-per-node", "2", "--max-restarts", "2",
             JOB, str(killed), "--steps", "12", "--every", "2", "--step-sleep", "1.0",
             "--kills", json.dumps([[1, 4, "step"]])],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 90  # a hang guard: the restart comes within ~15 s
        server = None
        while server is None and launcher.poll() is None and time.time() < deadline:
            time.sleep(0.1)
            server = _server_with_workers(psutil.Process(launcher.pid), 2)
        assert server is not None, "no worker was forked"
        # It says what it is: a worker's name does not find it.
        assert server.pid not in {p.pid for p in processes_with("shoal.launch.worker")}
        server.send_signal(signal.SIGKILL)
        _, err = launcher.communicate(timeout=150)
        assert launcher.returncode == 0, err[-3000:]
        assert reference.result().returncode == 0, reference.result().stderr
    assert f"shoal: the workers' server (shoal forkserver, pid {server.pid}) was killed by " \
        "SIGKILL: a new one starts this attempt's workers" in err, err[-6000:]
    a = torch.load(straight / "final.pt", weights_only=True)
    b = torch.load(killed / "final.pt", weights_only=True)
    for part in ("model", "optimizer", "rng"):
        assert states_equal(a[part], b[part]), part
