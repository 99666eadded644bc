"""Hang triage: a rank asleep in a step, a collective only rank 0 calls, and mismatched
collectives are each reported within the timeout with where every rank is; the job ends
non-zero and no process is left. With --debug torch names a mismatch at once."""

from __future__ import annotations

import textwrap
import uuid

import pytest

from tests.helpers import processes_with, run_shoal

SCRIPT = textwrap.dedent("""\
    import sys, time, torch, shoal
    shoal.init("gloo")
    mode, rank = sys.argv[1], shoal.rank()
    t = torch.ones(4)
    for step in range(6):
        shoal.heartbeat(step)
        if step == 3 and mode == "sleep" and rank == 1:
            time.sleep(600)                                   # line 8
        if step == 3 and mode == "mismatch":
            if rank == 0:
                shoal.all_reduce(torch.ones(4))               # line 11
            else:
                shoal.broadcast(torch.ones(4), src=1)         # line 13
        shoal.all_reduce(t)                                   # line 14
    if mode == "only0":
        if rank == 0:
            shoal.broadcast(torch.ones(4), src=0)             # line 17
        else:
            time.sleep(600)                                   # line 19
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / f"hang_{uuid.uuid4().hex[:8]}.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("mode, expected", [
    ("sleep", ["stuck: rank 1", "rank 0: inside all_reduce at {s}:14",
               "rank 1: not in a collective, at {s}:8"]),
    ("only0", ["stuck: rank 1", "rank 0: inside broadcast at {s}:17",
               "rank 1: not in a collective, at {s}:19"]),
    ("mismatch", ["mismatch: ranks wait in different collectives (all_reduce, broadcast)",
                  "rank 0: inside all_reduce at {s}:11", "rank 1: inside broadcast at {s}:13"]),
])
def test_hang_is_reported_with_every_rank_position(script, mode, expected):
    # The ranks sleep 600 s: the job can only end within the guard (90 s, some 10 times the
    # idle run) by the hang watch's report and stop, which 124 and the lines below show.
    out = run_shoal("run", "--nproc-per-node", "2", "--hang-timeout", "3", str(script), mode,
                    timeout=90)
    assert out.returncode == 124, out.stderr[-2000:]
    assert "shoal: hang: no rank made progress for 3 s" in out.stderr
    for line in expected:
        assert line.format(s=script) in out.stderr, out.stderr[-2000:]
    assert "rank*.stack" in out.stderr
    assert processes_with(script.name) == []


def test_debug_names_a_mismatched_collective_at_once(script):
    out = run_shoal("run", "--nproc-per-node", "2", "--hang-timeout", "60", "--debug",
                    str(script), "mismatch", timeout=90)
    assert out.returncode == 1
    assert "Detected mismatch between collectives on ranks" in out.stderr
    assert "OpType=ALLREDUCE" in out.stderr and "OpType=BROADCAST" in out.stderr
    assert processes_with(script.name) == []
