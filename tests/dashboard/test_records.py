"""Lines the dashboard cannot use: each one a bad line, none the end of the poller."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from shoal.dashboard import server
from shoal.dashboard.alerts import AlertSettings, check
from shoal.dashboard.records import parse
from shoal.dashboard.run import RunWatch
from tests.dashboard.conftest import EventStream
from tests.dashboard.synthetic import event_line, run_lines, step_line, window_line

STEP = json.loads(step_line(61))
WINDOW = json.loads(window_line(61, 62))
EVENT = json.loads(event_line("start", 0))


def _with(record: dict, **fields) -> str:
    return json.dumps({**record, **fields})


def _row(**fields) -> str:
    rows = [dict(WINDOW["ranks"][0]), dict(WINDOW["ranks"][1], **fields)]
    return json.dumps({**WINDOW, "ranks": [{k: v for k, v in r.items() if v != "drop"}
                                           for r in rows]})


MALFORMED = [
    '{"type": "ranks", "steps": [60, 61], "ranks": 5}',
    _row(rss_bytes="300 MB"), _row(rank="drop"), _row(rank=1.5), _row(cpu_percent=[1]),
    _with(WINDOW, ranks=[1, 2]), _with(WINDOW, steps=[60, True]), _with(WINDOW, steps=[60]),
    _with(WINDOW, straggler={"rank": 1, "phase": "data", "phase_excess_s": "6 ms"}),
    _with(WINDOW, straggler=[1]), _with(STEP, samples_per_s="fast"), _with(STEP, step="61"),
    _with(STEP, step=True), _with(STEP, loss={"mean": 1}), _with(STEP, rank_comm_s=[0.1, "x"]),
    _with(STEP, rank_step_s=0.1), _with(STEP, phases_s={"data": "slow"}),
    _with(STEP, tokens_per_s=[]), _with(STEP, mfu="40%"),
    _with(EVENT, memory_limit_bytes="24G"), _with(EVENT, kind=["end"]), _with(EVENT, step=None),
    '{"type": "validation", "step": 61, "val_loss": "low"}',
    '{"type": "step", "step": 61, "loss": NaN}', '{"type": "step", "step": 61, "loss": 1e999}',
    '{"type": "step", "step": 61, "lr": -Infinity}', "[" * 100_000, '"step"', "null",
    '{"type": "step", "step": 61, "type": "ranks"}', '{"type": ["step"], "step": "x"}',
]


@pytest.mark.parametrize("line", MALFORMED, ids=range(len(MALFORMED)))
def test_each_malformed_line_is_refused(line):
    assert parse(line.encode()) is None


def test_lines_shoal_writes_are_kept():
    for line in (step_line(1), window_line(1, 10, slow_rank=1), window_line(1, 10),
                 event_line("end", 5), '{"type": "validation", "step": 3, "val_loss": 0.5}',
                 '{"type": "step", "step": 4, "loss": null, "mfu": 0.4, "accuracy": 0.9}',
                 '{"type": "checkpoint", "step": 4, "path": "\\ud800"}'):
        assert parse(line.encode()) == json.loads(line), line


def test_a_run_full_of_them_is_read_and_checked(tmp_path):
    # The slowest check is on: the memory alerts read every rank of every window.
    lines = [event_line("start", 0)] + run_lines(60) + MALFORMED + [b"\xff\xfe".decode(
        "latin-1"), step_line(70)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"type": "step", "step": 71, "x": "\xff"}\n')
    run = RunWatch(tmp_path, 0)
    run.poll()
    assert run.bad_lines == len(MALFORMED) + 2  # and the two lines not UTF-8 or not JSON
    assert [p["step"] for p in run.points] == list(range(1, 61)) + [70]
    check(run, AlertSettings(growth_windows=2, memory_near=0.0))
    json.dumps(run.snapshot(), allow_nan=False)


def test_a_live_server_goes_on_after_every_malformed_line(serve, tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([event_line("start", 0)] + run_lines(60)) + "\n")
    said: list[str] = []
    base = serve([tmp_path], said=said, growth_windows=2, memory_near=0.0)
    stream = EventStream(base)
    try:
        stream.next()
        for k, line in enumerate(MALFORMED):
            with open(path, "a") as f:
                f.write(f"{line}\n{step_line(100 + k)}\n")
            seen: list[int] = []
            while 100 + k not in seen:  # the poller is alive: the next good line comes
                _, changes = stream.next(timeout=5)
                seen += [p["step"] for c in changes for p in c.get("points", [])]
    finally:
        stream.close()
    assert not [s for s in said if "while reading" in s]


def test_an_unforeseen_error_is_said_once_and_polling_goes_on(serve, tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "metrics.jsonl").write_text(event_line("start", 0) + "\n")
    broken = {"on": True}

    def failing_check(run, settings):
        if broken["on"] and run.name == "a":
            raise KeyError("rank")
        return check(run, settings)

    monkeypatch.setattr(server, "check", failing_check)
    said: list[str] = []
    base = serve([a, b], said=said)
    stream = EventStream(base)
    try:
        stream.next()
        for step in (1, 2, 3):
            for d in (a, b):
                with open(d / "metrics.jsonl", "a") as f:
                    f.write(step_line(step) + "\n")
            _, changes = stream.next()
            assert [c["run"] for c in changes] == [1]  # b is read while a fails
        broken["on"] = False
        with open(a / "metrics.jsonl", "a") as f:
            f.write(step_line(4) + "\n")
        _, changes = stream.next()
        assert [p["step"] for p in changes[0]["points"]] == [4]  # 1-3 were lost with the error
    finally:
        stream.close()
    errors = [s for s in said if "while reading" in s]
    assert errors == ["a: KeyError while reading: 'rank' (said once; polling goes on)"]


def test_a_dashboard_started_on_such_a_run_serves_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join([event_line("start", 0)] + run_lines(20) + MALFORMED) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "dashboard", str(tmp_path),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert "run(s) at http://127.0.0.1:" in line, proc.stderr.read()
        base = line.split(" at ")[1].split()[0].rstrip("/")
        with urllib.request.urlopen(base + "/api/snapshot", timeout=10) as r:
            run = json.loads(r.read())["runs"][0]
        assert run["bad_lines"] == len(MALFORMED) and len(run["points"]) == 20
        assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err


def test_a_line_too_long_to_be_a_record_is_a_bad_line(tmp_path, monkeypatch):
    from shoal.dashboard import tail

    monkeypatch.setattr(tail, "MAX_LINE", 1 << 16)
    lines = [event_line("start", 0), step_line(1), '{"type": "step", "x": "' + "x" * 200_000,
             step_line(2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = RunWatch(tmp_path, 0)
    run.poll()
    assert run.bad_lines == 1 and [p["step"] for p in run.points] == [1, 2]
