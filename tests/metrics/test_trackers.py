"""A user's own tracker (``shoal.Tracker``): given in code or named by import path, it gets
the run's config, every step's figures as metrics.jsonl has them, each validation, the
end-of-run table and final metrics, and its end; a resumed run continues the run id it
returned; what is no tracker is one line."""

from __future__ import annotations

import json

import pytest

import shoal
from shoal.errors import UsageError
from tests.ft.runs import step_metrics
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer


class Recorded(shoal.Tracker):
    """Every call, in order."""

    name = "mine"
    opened = 0

    def __init__(self):
        self.calls: list[tuple] = []

    def start(self, params, run_name, resume_id):
        Recorded.opened += 1
        self.calls.append(("start", run_name, resume_id))
        self.params = params
        return resume_id or f"mine-{Recorded.opened}"

    def log_metrics(self, step, values):
        self.calls.append(("log_metrics", step, dict(values)))

    def log_text(self, text, name):
        self.calls.append(("log_text", name, text))

    def log_dict(self, data, name):
        self.calls.append(("log_dict", name, data))

    def finish(self, status):
        self.calls.append(("finish", status))

    def of(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


def _trainer(tmp_path, trackers=(), **settings):
    model = make_model()
    metrics = {"dir": str(tmp_path / "run"), "every": 4, "resources": False,
               **settings.pop("metrics", {})}
    return shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                         batch_size=16, checkpoint_dir=str(tmp_path / "ckpt"),
                         metrics=metrics, trackers=trackers, **settings)


def test_a_tracker_gets_the_runs_figures_and_continues_its_run_on_resume(
        single_process, tmp_path):
    tracker = Recorded()
    result = _trainer(tmp_path, trackers=[tracker]).fit(make_dataset(64), make_dataset(32),
                                                        epochs=2)
    start, *_ = tracker.calls
    assert start == ("start", "run", None)
    assert tracker.params["trainer"]["batch_size"] == 16
    steps = {step: values for _, step, values in tracker.of("log_metrics")
             if "train/loss" in values}
    written = step_metrics(tmp_path / "run")
    assert sorted(steps) == [s for s, *_ in written] == list(range(1, 9))
    assert all(steps[s]["train/loss"] == loss for s, loss, *_ in written)
    rates = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl")
                                              .read_text().splitlines()) if r["type"] == "step"}
    assert all(steps[s]["train/lr"] == rates[s] for s in steps)
    validations = [(step, values) for _, step, values in tracker.of("log_metrics")
                   if "val_loss" in values]
    assert [step for step, _ in validations] == [4, 8]
    assert validations[-1][1]["val_loss"] == result["val_loss"]
    assert [name for _, name, _ in tracker.of("log_text")] == ["summary.txt"]
    assert tracker.of("log_dict") == [("log_dict", "metrics.json", result)]
    assert tracker.calls[-1] == ("finish", "FINISHED")
    # Resumed for a third epoch: the same run, continued.
    again = Recorded()
    _trainer(tmp_path, trackers=[again], resume="auto").fit(make_dataset(64),
                                                            make_dataset(32), epochs=3)
    assert again.calls[0] == ("start", "run", "mine-1")
    assert min(step for _, step, _ in again.of("log_metrics")) == 9
    assert json.loads((tmp_path / "run" / "trackers.json").read_text()) == \
        {"mine_run_id": "mine-1"}


def test_a_tracker_by_import_path_and_what_is_no_tracker(single_process, tmp_path,
                                                         monkeypatch):
    monkeypatch.setattr(Recorded, "opened", 0)
    trainer = _trainer(tmp_path, metrics={"trackers": [f"{__name__}:Recorded"]})
    trainer.fit(make_dataset(32), epochs=1)
    assert Recorded.opened == 1
    with pytest.raises(UsageError, match=r"^trainer.metrics.trackers\[0\]: OrderedDict is "
                                         r"not a shoal.Tracker \(subclass it"):
        _trainer(tmp_path / "other", metrics={"trackers": ["collections:OrderedDict"]}).fit(
            make_dataset(32), epochs=1)
