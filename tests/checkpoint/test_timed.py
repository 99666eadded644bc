"""Timed checkpoints: rank 0's clock decides, every rank saves at the same step."""

from __future__ import annotations

import time

import shoal
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer


def _train(directory: str):
    shoal.init("gloo")
    model = make_model()
    optimizer = make_optimizer(model)
    optimizer.register_step_post_hook(lambda *_: time.sleep(0.05))
    trainer = shoal.Trainer(model, optimizer, batch_size=8, seed=SEED, progress=False,
                            checkpoint_dir=directory, checkpoint_every_seconds=0.3,
                            keep_last=100)
    trainer.fit(make_dataset(), max_steps=24)
    return trainer.checkpointing.saved_step


def test_checkpoint_every_seconds(tmp_path):
    results = shoal.spawn(_train, nprocs=2, args=(str(tmp_path),))
    assert results == [24, 24]
    steps = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("step_*"))
    # About 24 x 0.05 s = 1.2 s of training: a few timed saves, plus the final one.
    assert 3 <= len(steps) <= 8 and steps[-1] == 24, steps
    assert all(b - a >= 3 for a, b in zip(steps, steps[1:-1], strict=False)), steps
