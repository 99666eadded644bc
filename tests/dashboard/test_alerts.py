"""Each alert fires on the records that call for it, and not on a healthy run."""

from __future__ import annotations

import os
import struct
import time

from shoal.dashboard.alerts import AlertSettings, check
from shoal.dashboard.run import RunWatch
from shoal.runtime import heartbeat
from tests.dashboard.synthetic import event_line, run_lines, step_line, window_line

SETTINGS = AlertSettings(silence_s=5)


def _run(tmp_path, lines):
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("".join(line + "\n" for line in lines))
    run = RunWatch(tmp_path, 0)
    run.poll()
    return run


def test_a_healthy_run_raises_none(tmp_path):
    run = _run(tmp_path, [event_line("start", 0)] + run_lines(200, every=10))
    assert check(run, SETTINGS) == {}


def test_a_run_that_stopped_writing_is_named_with_its_last_step(tmp_path):
    run = _run(tmp_path, [event_line("start", 0)] + run_lines(30))
    assert check(run, SETTINGS) == {}
    alerts = check(run, SETTINGS, now=time.time() + 7)
    assert alerts["silent"].startswith(f"{tmp_path.name}: no metrics for 7 s after step 30")
    # An ended run is quiet by right.
    run = _run(tmp_path, [event_line("end", 30)])
    assert "silent" not in check(run, SETTINGS, now=time.time() + 7)


def test_the_rank_whose_heartbeat_stopped_first_is_named(tmp_path):
    beats = tmp_path / "logs" / "run-x" / "heartbeats"
    beats.mkdir(parents=True)
    now = time.time()
    for rank, (when, step) in enumerate([(now, 41), (now - 30, 12), (now, 41)]):
        (beats / f"rank{rank}.beat").write_bytes(
            struct.pack("<dqq", when, step, os.getpid()))
    assert heartbeat.read(str(beats / "rank1.beat"))[1] == 12
    run = _run(tmp_path, [event_line("start", 0)] + run_lines(12))
    message = check(run, SETTINGS, now=now + 60)["silent"]
    assert message.endswith("rank 1 beat last at step 12, 30 s before the others")


def test_a_nonfinite_loss_is_named_by_its_step(tmp_path):
    run = _run(tmp_path, [event_line("start", 0)] + run_lines(20)
               + [step_line(21, loss=float("inf")), step_line(22, loss=float("nan"))])
    assert check(run, SETTINGS) == {
        "nonfinite:21": f"{tmp_path.name}: the loss is not finite at step 21 "
                        "(and 1 later points)"}


def test_a_throughput_drop_is_seen_against_the_runs_median(tmp_path):
    lines = [event_line("start", 0)] + run_lines(100)
    run = _run(tmp_path, lines + [step_line(s, slower=1.3) for s in range(101, 121)])
    assert check(run, SETTINGS) == {}  # 25 % slower: within the usual
    run = _run(tmp_path, [step_line(s, slower=3) for s in range(121, 141)])
    assert check(run, SETTINGS) == {"throughput": (
        f"{tmp_path.name}: throughput fell to 4,000 samples/s over the last 20 points, "
        "38% of the run's median 10,667")}


def test_memory_near_the_limit_and_memory_that_keeps_growing(tmp_path):
    limit = 1 << 30
    lines = [event_line("start", 0, memory_limit=limit)]
    for k in range(8):
        lines += [step_line(s) for s in range(10 * k + 1, 10 * k + 11)]
        lines.append(window_line(10 * k + 1, 10 * k + 10, rss=0.3 * limit * 1.1 ** k))
    run = _run(tmp_path, lines)
    alerts = check(run, SETTINGS)
    assert set(alerts) == {"growth:0", "growth:1"}
    assert "rank 0's memory grew in each of the last 6 windows, from 338 MB to 599 MB " \
        "(steps 20-80)" in alerts["growth:0"]
    run = _run(tmp_path, [window_line(81, 90, rss=0.95 * limit)])
    alerts = check(run, SETTINGS)
    assert {"memory:0", "memory:1"} <= set(alerts)
    assert alerts["memory:1"] == (f"{tmp_path.name}: rank 1 holds 973 MB, 95% of the "
                                  "1,024 MB its machine allows")
