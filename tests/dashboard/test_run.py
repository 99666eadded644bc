"""A run directory as the dashboard keeps it: thinned as it grows, restarts redone."""

from __future__ import annotations

import json

from shoal.dashboard.run import RunWatch
from tests.dashboard.synthetic import event_line, run_lines, step_line


def _write(path, lines, mode="a"):
    with open(path / "metrics.jsonl", mode) as f:
        f.write("".join(line + "\n" for line in lines))


def test_points_are_thinned_to_the_cap_and_a_nonfinite_loss_is_kept(tmp_path):
    _write(tmp_path, [event_line("start", 0)] + run_lines(1000, every=10))
    _write(tmp_path, [step_line(1001, loss=float("nan"))])  # written as null
    _write(tmp_path, run_lines(999, every=10, start=1002))
    run = RunWatch(tmp_path, 0, cap=300, window_cap=50)
    change = run.poll()
    assert len(run.points) <= 300 and run.stride == 8
    steps = [p["step"] for p in run.points]
    assert steps == sorted(steps) and 1001 in steps  # the bad step survives the thinning
    assert all(s % 8 == 0 for s in steps if s != 1001)
    assert len(run.windows) <= 50 and run.windows[-1]["steps"] == [1991, 2000]
    assert change["points"] == run.points and run.poll() is None


def test_only_new_lines_make_a_change(tmp_path):
    _write(tmp_path, [event_line("start", 0)] + run_lines(10))
    run = RunWatch(tmp_path, 0)
    assert len(run.poll()["points"]) == 10
    _write(tmp_path, run_lines(5, start=11) + ['{"type": "step", "st'])
    change = run.poll()
    assert [p["step"] for p in change["points"]] == [11, 12, 13, 14, 15]
    assert "replace" not in change and len(run.points) == 15


def test_a_restart_redoes_the_steps_after_its_checkpoint(tmp_path):
    _write(tmp_path, [event_line("start", 0)] + run_lines(50, every=10))
    run = RunWatch(tmp_path, 0)
    run.poll()
    _write(tmp_path, [event_line("start", 30, restart=1)] + run_lines(5, every=10, start=31))
    change = run.poll()
    assert [p["step"] for p in run.points] == list(range(1, 36))
    assert change["replace"] == ["points", "windows"]
    assert change["points"] == run.points
    assert [w["steps"][1] for w in run.windows] == [10, 20, 30]
    assert [e["kind"] for e in run.events] == ["start", "start"] and not run.ended
    _write(tmp_path, [json.dumps({"type": "event", "step": 35, "kind": "end"})])
    run.poll()
    assert run.ended


def test_lines_that_are_not_json_are_counted_and_skipped(tmp_path):
    _write(tmp_path, ["not json", "[1, 2]", step_line(1)])
    run = RunWatch(tmp_path, 0)
    run.poll()
    assert run.bad_lines == 2 and len(run.points) == 1


def test_a_metrics_file_started_anew_starts_the_run_anew(tmp_path):
    _write(tmp_path, [event_line("start", 0)] + run_lines(50))
    run = RunWatch(tmp_path, 0)
    run.poll()
    run.name = "kept"
    _write(tmp_path, [event_line("start", 0)] + run_lines(3), mode="w")
    change = run.poll()
    assert [p["step"] for p in change["points"]] == [1, 2, 3] and run.name == "kept"
    assert change["reset"]
    assert [p["step"] for p in run.points] == [1, 2, 3]
