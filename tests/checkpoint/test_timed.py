"""Timed checkpoints: rank 0's clock decides, every rank saves at the same step."""

from __future__ import annotations

import time

import shoal
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

EVERY_S, STEP_SLEEP_S, STEPS = 0.35, 0.1, 24


def _train(directory: str):
    shoal.init("gloo")
    model = make_model()
    optimizer = make_optimizer(model)
    optimizer.register_step_post_hook(lambda *_: time.sleep(STEP_SLEEP_S))
    trainer = shoal.Trainer(model, optimizer, batch_size=8, seed=SEED, progress=False,
                            checkpoint_dir=directory, checkpoint_every_seconds=EVERY_S,
                            keep_last=100)
    start = time.monotonic()
    trainer.fit(make_dataset(), max_steps=STEPS)
    return trainer.checkpointing.saved_step, time.monotonic() - start


def test_checkpoint_every_seconds(tmp_path):
    results = shoal.spawn(_train, nprocs=2, args=(str(tmp_path),))
    assert [r[0] for r in results] == [STEPS, STEPS]
    elapsed = max(r[1] for r in results)
    steps = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("step_*"))
    timed = steps[:-1] if steps[-1] == STEPS else steps  # the last one is fit's final save
    # At most one timed save per EVERY_S of training, and some did happen.
    assert 2 <= len(timed) <= elapsed / EVERY_S + 1, (steps, elapsed)
    # A save is never repeated on the next step (a step lasts well under EVERY_S).
    assert all(b - a >= 2 for a, b in zip(timed, timed[1:], strict=False)), steps
