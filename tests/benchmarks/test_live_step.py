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
