"""Live mode on one machine: replica groups, a lighthouse, a group killed mid-step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import states_equal

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(300)

JOB = str(Path(__file__).with_name("live_job.py"))
STEPS = 16


def _shoal_run(out: Path, *flags: str, kills: tuple[str, ...] = ()) -> subprocess.Popen:
    out.mkdir()
    cmd = [sys.executable, "-m", "shoal", "run", "--hang-timeout", "0", *flags, JOB, str(out),
           str(STEPS), *[arg for kill in kills for arg in ("--kill", kill)]]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output[-4000:]
    return output


def _final(out: Path, group: int, rank: int = 0) -> dict:
    return torch.load(out / f"final.g{group}.r{rank}.pt")


def test_exact_killed_group_heals_and_run_equals_ddp(tmp_path):
    """A group SIGKILLed mid-step: the other one is never restarted and waits in memory, the
    replacement heals from it, the interrupted step is done again, and both end bitwise
    equal to today's 2-process DDP run without failures."""
    reference = _shoal_run(tmp_path / "ddp", "--nproc-per-node", "2")
    live = _shoal_run(tmp_path / "live", "--replica-groups", "2", "--max-restarts", "1",
                      kills=("1:6",))
    output = _finish(live)
    _finish(reference)
    pids = sorted(p.name for p in (tmp_path / "live").glob("pid.*"))
    assert pids == ["pid.g0.a0.r0", "pid.g1.a0.r0", "pid.g1.a1.r0"]  # group 0 never restarted
    assert "replica group 0: step 7 did not commit" in output
    assert "replica group 1: healed from a live group at step 6" in output
    for group in (0, 1):
        live_state, ddp_state = _final(tmp_path / "live", group), _final(tmp_path / "ddp", 0,
                                                                          group)
        assert live_state["step"] == STEPS
        assert states_equal(live_state["model"], ddp_state["model"])
        assert states_equal(live_state["optimizer"], ddp_state["optimizer"])
