"""Step metrics: the phases add up to the step, a slow rank is named with its slow phase,
and the files load with the standard readers."""

from __future__ import annotations

import json
import time

import pytest
from torch.utils.data import Dataset

import shoal
from shoal.metrics.stragglers import find_straggler
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

SLEEP = 0.012  # seconds per sample on the slow rank: 96 ms per batch of 8, well above the
# scheduling noise of a shared 2-core machine
STEPS, EVERY = 24, 6


class SlowOnRank(Dataset):
    """The reference data; loading a sample sleeps on one rank only."""

    def __init__(self, slow_rank: int | None):
        self.data = make_dataset()
        self.slow = slow_rank == shoal.rank()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        if self.slow:
            time.sleep(SLEEP)
        return self.data[index]


def _fit(directory: str, slow_rank: int | None):
    shoal.init("gloo")
    model = make_model()
    optimizer = make_optimizer(model)
    stamps: list[float] = []
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    trainer = shoal.Trainer(model, optimizer, batch_size=8, seed=SEED, progress=False,
                            metrics={"dir": directory, "every": EVERY,
                                                      "grad_norm_every": 3})
    trainer.fit(SlowOnRank(slow_rank), max_steps=STEPS)
    return stamps


def _records(directory, kind):
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def test_slow_data_on_one_rank_is_named_and_phases_add_up(tmp_path):
    stamps = shoal.spawn(_fit, nprocs=2, args=(str(tmp_path), 1))[0]
    steps = _records(tmp_path, "step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["lr"] == 0.1 for r in steps)
    # The norm is measured every third step only; the others say so with null.
    assert all((r["grad_norm"] > 0) if r["step"] % 3 == 0 else r["grad_norm"] is None
               for r in steps), [r["grad_norm"] for r in steps]
    # Our step clock against the optimizer's own: steps 2..N span the same time.
    measured = sum(r["step_time_s"] for r in steps[1:])
    external = stamps[-1] - stamps[0]
    assert abs(measured - external) <= 0.05 * external, (measured, external)
    windows = _records(tmp_path, "ranks")
    assert len(windows) == STEPS // EVERY
    for window in windows:
        for rank in window["ranks"]:
            named = sum(rank[p] for p in ("data", "compute", "comm", "optimizer"))
            assert named >= 0.95 * rank["step"], rank  # 'other' is under 5 %
            assert rank["rss_bytes"] > 0
        assert window["straggler"] is not None, window
        assert window["straggler"]["rank"] == 1
        assert window["straggler"]["phase"] == "data"
    # Rank 0 waits for rank 1 in communication: over the run, by most of rank 1's data time.
    waited = [sum(w["ranks"][r]["comm"] for w in windows) for r in (0, 1)]
    slow_data = sum(w["ranks"][1]["data"] for w in windows)
    assert waited[0] - waited[1] > 0.5 * slow_data, (waited, slow_data)


def test_tensorboard_events_load_with_the_standard_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shoal.spawn(_fit, nprocs=2, args=(str(tmp_path), None))
    losses = [r["loss"] for r in _records(tmp_path, "step")]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == list(range(1, STEPS + 1))
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)
    assert "rank1/rss_bytes" in events.Tags()["scalars"]


def test_find_straggler():
    def rank(data=1.0, compute=2.0, comm=1.0, optimizer=0.5, other=0.1):
        return {"data": data, "compute": compute, "comm": comm, "optimizer": optimizer,
                "other": other, "step": data + compute + comm + optimizer + other}
    assert find_straggler([rank()]) is None
    assert find_straggler([rank(), rank(comm=1.05)]) is None
    # Rank 2's compute is slow; the others wait in comm, so all steps last as long.
    found = find_straggler([rank(comm=3.0), rank(comm=3.0), rank(compute=4.0, comm=1.0)])
    assert (found["rank"], found["phase"]) == (2, "compute")
    assert found["phase_excess_s"] == pytest.approx(2.0)


class _Comm:  # what a step sent and waited for (none here)
    wait = blocked = bytes = 0.0


def test_a_replacement_writes_the_steps_kept_for_it_after_its_file(tmp_path):
    """A live replacement of the writing group: the steps another group kept for it
    (``StepFigures``) are written after the last step the file holds (a window the group
    it replaces wrote is not written again), with the kept wall time and no split; its
    start is marked at the step before the first one it writes; windows end at every
    ``every``-th step, also after a start mid-window."""
    import torch

    from shoal.metrics.recorder import MetricsConfig, StepMetrics

    config = MetricsConfig(dir=str(tmp_path), every=4, resources=False, tensorboard=False)
    first = StepMetrics(config, torch.device("cpu"), 0, 1)
    for step in range(1, 7):  # steps 5 and 6 are lost with it
        first.step(step, 0, 0.1, torch.tensor(float(step)), None, 8, 0, _Comm())
    first.close()
    kept = [(step, 0, 0.1, torch.tensor(float(step), dtype=torch.float64), None, 8, 0, 0.0,
             0.5) for step in range(3, 7)]
    second = StepMetrics(config, torch.device("cpu"), 0, 1, announce=False)
    assert second.writer is not None and second.writer.last_step() == 4
    before = second.adopt(kept)
    second.started(before)
    second.step(7, 0, 0.1, torch.tensor(7.0), None, 8, 0, _Comm())
    second.finish(show_summary=False)
    second.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert before == 4
    assert [(r["type"], r.get("step", r.get("steps"))) for r in lines] == [
        ("event", 0), *(("step", s) for s in range(1, 5)), ("ranks", [1, 4]),
        ("event", 4), *(("step", s) for s in range(5, 8)), ("ranks", [5, 7])]
    adopted = [r for r in lines if r["type"] == "step" and r["step"] in (5, 6)]
    assert [r["loss"] for r in adopted] == [5.0, 6.0]
    assert all(r["step_time_s"] == 0.5 and r["samples_per_s"] == 16
               and set(r["phases_s"].values()) == {None} for r in adopted)
