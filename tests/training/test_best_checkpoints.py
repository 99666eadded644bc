"""`shoal.BestCheckpoints`: the checkpoints of the best validations kept beside the newest
ones, each the run's state at its step, named in best.json; a resume takes the newest."""

from __future__ import annotations

import json

import pytest

import shoal
from shoal.checkpoint import CheckpointStore
from shoal.errors import UsageError
from tests.helpers import states_equal
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer


class Validations(shoal.Callback):
    """Each validation's val_loss, by step."""

    def __init__(self):
        self.seen: dict[int, float] = {}

    def on_validation_end(self, trainer, metrics):
        self.seen[metrics["step"]] = metrics["val_loss"]


def _fit(tmp_path, best, epochs=3, **settings):
    model, seen = make_model(), Validations()
    trainer = shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                            batch_size=16, val_every_steps=2, checkpoint_every=1, keep_last=2,
                            checkpoint_dir=str(tmp_path), callbacks=[best, seen], **settings)
    trainer.fit(make_dataset(64), make_dataset(32), epochs=epochs)
    return trainer, seen.seen


def test_the_best_validations_checkpoints_are_kept_beside_the_newest(single_process,
                                                                       tmp_path):
    """mode 'max' on val_loss, which falls at first: step 2's validation is among the best,
    older than the newest 2 checkpoints, and kept; each holds the weights of its step."""
    best = shoal.BestCheckpoints("val_loss", mode="max", save_top_k=2)
    trainer, seen = _fit(tmp_path, best)
    ranked = sorted(seen.items(), key=lambda item: (-item[1], item[0]))[:2]
    assert best.best == [(value, step) for step, value in ranked]
    assert best.best_step == ranked[0][0]
    store = CheckpointStore(tmp_path)
    newest = trainer.global_step
    assert 2 in {step for _, step in best.best} and newest == 12
    kept = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("step_*"))
    assert kept == sorted({newest - 1, newest, *(step for _, step in best.best)})
    listed = json.loads((tmp_path / "best.json").read_text())
    assert listed["monitor"] == "val_loss" and [(e["val_loss"], e["step"], e["path"])
                                                for e in listed["best"]] == \
        [(v, s, store.path_for(s).name) for v, s in best.best]
    # Step 2's checkpoint holds the weights after step 2: the same run stopped there.
    again, _ = _fit(tmp_path / "short", shoal.BestCheckpoints(), epochs=None, max_steps=2)
    saved = store.load(store.path_for(2))[0]["model"]
    assert states_equal(saved, again.module.state_dict())
    assert store.latest() == store.path_for(newest)  # a resume takes the newest


def test_settings_that_cannot_work_are_one_line(single_process, tmp_path):
    with pytest.raises(UsageError, match="save_top_k must be at least 1"):
        shoal.BestCheckpoints(save_top_k=0)
    with pytest.raises(UsageError, match="mode must be 'min' or 'max'"):
        shoal.BestCheckpoints(mode="lowest")
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), progress=False, batch_size=16,
                            callbacks=[shoal.BestCheckpoints()])
    with pytest.raises(UsageError, match="BestCheckpoints needs a checkpoint_dir"):
        trainer.fit(make_dataset(32))
    with pytest.raises(UsageError, match=r"BestCheckpoints: validation gives no 'val_f1'"):
        _fit(tmp_path, shoal.BestCheckpoints("val_f1"), epochs=1)
