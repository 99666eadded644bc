"""Preemption: SIGTERM (or SIGUSR1) to `shoal run` mid-run: a checkpoint at the next step
boundary, exit code 128 + signal, and the next run resumes exactly."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.checkpoint.test_resume import JOB, RUN_S, _final
from tests.helpers import popen_shoal, processes_with, run_shoal, states_equal

# Hang guards, several times the idle time: the job is three steps in ~10 s after its start
# (~25 s seen on a loaded machine); the signalled job saves and exits within a few seconds.
READY_S, STOP_S = 150, 90


@pytest.mark.timeout(READY_S + STOP_S + RUN_S + 30)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_exits_and_resumes_exactly(tmp_path, sig):
    run = tmp_path / "run"
    run.mkdir()
    launcher = popen_shoal("run", "--nproc-per-node", "2", JOB, str(run), "--steps", "500",
                           "--every", "1000", "--step-sleep", "0.05", text=True)
    deadline = time.time() + READY_S
    while not (run / "ready").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert (run / "ready").exists(), "the job never got going"
    launcher.send_signal(sig)
    try:
        _, err = launcher.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:  # a hang: say who is still there, then clean up
        left = [(p.pid, " ".join(p.cmdline()[:4])) for p in processes_with(str(run))]
        for process in processes_with(str(run)):
            process.kill()
        launcher.kill()
        pytest.fail(f"the job did not end within {STOP_S} s of {sig.name}; launcher "
                    f"{launcher.pid} {'ended' if launcher.poll() is not None else 'running'}"
                    f", its workers still running: {left}")
    assert launcher.returncode == 128 + sig, err[-2000:]
    found = re.search(rf"preempted by {sig.name} at step (\d+)", err)
    assert found, err[-2000:]
    stopped_at = int(found.group(1))
    assert 3 <= stopped_at < 500
    assert (run / "checkpoints" / f"step_{stopped_at:09d}" / "COMMIT.json").exists()
    assert processes_with(str(run)) == []

    target = stopped_at + 6
    straight = tmp_path / "straight"
    straight.mkdir()
    # The uninterrupted reference runs beside the resume: they share nothing.
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(run_shoal, "run", "--nproc-per-node", "2", JOB, str(straight),
                                "--steps", str(target), "--no-checkpoints", timeout=RUN_S)
        out = run_shoal("run", "--nproc-per-node", "2", JOB, str(run), "--steps", str(target),
                        "--every", "1000", timeout=RUN_S)
    assert out.returncode == 0, out.stderr
    assert f"resumed from {run}/checkpoints/step_{stopped_at:09d}" in out.stderr
    assert reference.result().returncode == 0, reference.result().stderr
    a, b = _final(straight), _final(run)
    assert states_equal(a["model"], b["model"]) and states_equal(a["optimizer"],
                                                                   b["optimizer"])
    assert torch.equal(a["rng"], b["rng"])
    assert a["train_loss"] == b["train_loss"]  # the epoch's, also where the stop cut it
