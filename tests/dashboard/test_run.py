"""A run directory as the dashboard keeps it: thinned as it grows, restarts redone."""

from __future__ import annotations

import json
import random

import pytest

from shoal.dashboard import tail
from shoal.dashboard.run import NONFINITE_LOSS, STEP_PREFIX, RunWatch
from tests.dashboard.synthetic import event_line, run_lines, step_line, window_line


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


def test_lines_that_are_not_records_are_counted_and_skipped(tmp_path):
    # JSON that does not say which step it is of cannot be placed on a curve either.
    _write(tmp_path, ["not json", "[1, 2]", step_line(1), '{"type": "step"}',
                      '{"type": "ranks", "steps": "all"}', event_line("start", 1)])
    run = RunWatch(tmp_path, 0)
    run.poll()
    assert run.bad_lines == 4 and len(run.points) == 1 and len(run.events) == 1


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


class LineByLine(RunWatch):
    """The reference reader: every line looked at in turn."""

    def _take_block(self, block, new):
        for line in bytes(block).split(b"\n"):
            if line.startswith(STEP_PREFIX):
                self.seen_steps += 1
                if self.seen_steps % self.stride == 0 or NONFINITE_LOSS in line:
                    self._take_step(line, new)
            else:
                self._take(line, new)


def test_a_run_whose_loss_stays_nan_keeps_its_cap_and_where_it_diverged(tmp_path):
    _write(tmp_path, [event_line("start", 0)] + [step_line(s) for s in range(1, 101)])
    _write(tmp_path, [step_line(s, loss=float("nan")) for s in range(101, 1301)])
    run = RunWatch(tmp_path, 0, cap=16)
    run.poll()
    _write(tmp_path, [step_line(1301, loss=float("nan"))])
    run.poll()
    steps = [p["step"] for p in run.points]
    assert len(steps) <= 16 and run.stride <= 256, (len(steps), run.stride)
    assert 101 in steps  # the first NaN step is kept


def _random_run(rng: random.Random, steps: int) -> bytes:
    """A run as shoal writes one, with what can go wrong in it: restarts from earlier
    steps, non-finite losses, empty, cut and non-JSON lines."""
    lines, step = [event_line("start", 0)], 0
    while step < steps:
        r = rng.random()
        if r < 0.85:
            step += 1
            lines.append(step_line(step, loss=float("nan") if rng.random() < 0.01 else None))
        elif r < 0.9:
            lines.append(window_line(max(step - 9, 0), step))
        elif r < 0.92:
            lines.append(json.dumps({"type": "validation", "step": step, "loss": 1.0}))
        elif r < 0.93:
            step = max(0, step - rng.randint(0, 30))
            lines.append(event_line(rng.choice(["start", "resume"]), step, restart=1))
        else:
            lines.append(rng.choice(["", "not json", "[1, 2]", step_line(step)[:40],
                                     window_line(1, 2)[:30], '{"type": "step"}']))
    lines.append(event_line("end", step))
    return "".join(line + "\n" for line in lines).encode()


def _page(shown: dict, change: dict | None) -> None:
    """What the page does with a poll's change: a list it names in 'replace' is taken
    whole, the others are appended to."""
    if change is None:
        return
    if change.get("reset"):
        shown.clear()
    for name in ("points", "windows", "validation", "events"):
        if name in change.get("replace", ()):
            shown[name] = list(change[name])
        else:
            shown.setdefault(name, []).extend(change.get(name, []))


@pytest.mark.parametrize("seed", range(12))
def test_a_run_read_in_any_pieces_is_what_the_line_by_line_reader_keeps(tmp_path, seed,
                                                                        monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(tail, "CHUNK", rng.choice([700, 5000, 1 << 20]))
    data = _random_run(rng, rng.choice([300, 3000, 8000]))
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"")
    caps = {"cap": rng.choice([16, 50, 2000]), "window_cap": rng.choice([8, 1000])}
    fast, reference = RunWatch(tmp_path, 0, **caps), LineByLine(tmp_path, 0, **caps)
    shown: dict = {}
    cuts = sorted(rng.sample(range(1, len(data)), rng.choice([0, 1, 5, 40]))) + [len(data)]
    written = 0
    for cut in cuts:  # appended in pieces that end anywhere, mid-line too
        with open(path, "ab") as f:
            f.write(data[written:cut])
        written = cut
        _page(shown, fast.poll())
        reference.poll()
        assert fast.snapshot() == reference.snapshot()
        for name in ("points", "windows", "validation", "events"):
            assert shown.get(name, []) == getattr(fast, name)
    assert fast.ended and fast.seen_steps == reference.seen_steps
