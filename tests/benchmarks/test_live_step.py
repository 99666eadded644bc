"""benchmarks/live_step.py's reading of a run's marks: each phase from one mark to the
next, the last to the next step's forward, so that the phases add up to the step."""

from __future__ import annotations

import pytest

from tests.benchmarks import load


def _live_step():
    return load("live_step")


def _marks(module, steps: int, lengths: list[float], slow: int | None = None) -> dict:
    """``steps`` steps whose phases last ``lengths`` (step ``slow``'s twice as long)."""
    marks = {name: [] for name in module.MARKS}
    now = 0.0
    for step in range(steps):
        for name, length in zip(module.MARKS, lengths, strict=True):
            marks[name].append(now)
            now += length * (2 if step == slow else 1)
    return marks


def test_each_phase_runs_to_the_next_mark_and_they_add_up_to_the_step():
    module = _live_step()
    lengths = [1.0, 0.5, 3.0, 0.25, 2.0, 0.125]
    figures = module.phases(_marks(module, 8, lengths, slow=4), skip=2)
    assert [figures[name] for name in module.PHASES] == lengths  # (one slow step moves no median)
    assert figures["step"] == sum(lengths)


def test_too_few_steps_past_the_skipped_ones_are_refused():
    module = _live_step()
    with pytest.raises(ValueError, match="3 steps marked"):
        module.phases(_marks(module, 4, [1.0] * 6), skip=3)


def test_the_report_gives_each_live_phase_with_its_difference_from_ddps():
    module = _live_step()
    ddp = dict.fromkeys((*module.PHASES, "step"), 0.001)
    live = {**ddp, "loss": 0.0015, "step": 0.00125}
    results = {"DDP": [ddp, ddp], "live exact": [live, live], "live available": [ddp, ddp]}
    lines = module.report(results)
    loss = next(line for line in lines if line.strip().startswith("loss"))
    assert "1.500 (+0.500)" in loss and "1.000 (+0.000)" in loss
    assert any(line.strip().startswith("live exact: 0.80 x") for line in lines)


def test_the_calls_a_step_are_each_modes_workers_mean_with_the_difference_from_ddps(
        monkeypatch):
    module = _live_step()
    counted = {"DDP": [1000.0, 1002.0], "live exact": [1120.0, 1130.0],
               "live available": [1050.0, 1051.0]}
    seen = []

    def output(mode, steps, compression, name, extra=()):
        seen.append((name, extra))
        return counted[mode]

    monkeypatch.setattr(module, "_job_output", output)
    assert module.calls(1000, "topk", 200) == [
        "  DDP: 1001 Python calls a step", "  live exact: 1125 Python calls a step (+124)",
        "  live available: 1050 Python calls a step (+50)"]
    assert seen == [("calls", ("--calls-from", "201"))] * 3  # from the first step past --skip


def test_the_cpu_shares_split_workers_main_threads_their_others_and_the_other_processes():
    import os

    module = _live_step()
    tick = os.sysconf("SC_CLK_TCK")
    lighthouse = "python -m shoal.ft.lighthouse --bind 127.0.0.1:1"
    before = {(10, 10): ("python -m shoal run", "python", 0, 0),  # a worker's main thread
              (10, 11): ("python -m shoal run", "gloo_tcp_loop", 0, 5),
              (20, 20): ("python -m shoal run", "python", 0, 0),
              (20, 21): ("python -m shoal run", "gloo_tcp_loop", 0, 5),
              (30, 30): (lighthouse, "python", 0, 0),
              (40, 40): ("python -m shoal run", "python", 0, 0)}  # a launcher
    after = {(10, 10): ("python -m shoal run", "python", tick, 30),
             (10, 11): ("python -m shoal run", "gloo_tcp_loop", tick // 10, 50),
             (20, 20): ("python -m shoal run", "python", tick // 2, 10),
             (20, 21): ("python -m shoal run", "gloo_tcp_loop", 0, 5),
             (30, 30): (lighthouse, "python", tick // 50, 0),
             (40, 40): ("python -m shoal run", "python", 0, 0),
             (50, 50): ("python -m shoal run", "python", tick, 0)}  # (not in both: left out)
    lines = module.cpu_shares(before, after, seconds=2.0, steps=10, workers={10, 20})
    assert lines == ["    workers' main threads: 37.5 %",  # (50 % + 25 %) / 2 workers
                     "    workers' gloo_tcp_loop threads: 2.5 %",
                     "    the lighthouse: 1.0 %",
                     "    a worker's main thread made to wait for a core: 2.00 times a step"]
