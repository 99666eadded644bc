"""Asynchronous checkpoints hold the state of the step they were taken at, not a later one."""

from __future__ import annotations

import shutil

import torch

import shoal
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer


def _trainer(**settings) -> shoal.Trainer:
    model = make_model()
    return shoal.Trainer(model, make_optimizer(model), batch_size=8, seed=SEED,
                         progress=False, **settings)


def test_async_checkpoint_resumes_exactly(tmp_path, single_process):
    straight = _trainer()
    straight.fit(make_dataset(), max_steps=9)

    first = _trainer(checkpoint_dir=str(tmp_path), checkpoint_every=2, async_checkpoint=True,
                     keep_last=10)
    first.fit(make_dataset(), max_steps=5)
    # Steps 2 and 4 were saved in the background while training went on; 5 at the end.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_000000002", "step_000000004", "step_000000005"]
    # Resume from step 4 (drop the final one): the saved state must be step 4's own.
    shutil.rmtree(tmp_path / "step_000000005")
    resumed = _trainer(checkpoint_dir=str(tmp_path), resume="auto", async_checkpoint=True)
    steps: list[int] = []  # a run that ignored the checkpoint would end the same: count
    resumed.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    resumed.fit(make_dataset(), max_steps=9)
    assert len(steps) == 5
    a, b = straight.module.state_dict(), resumed.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
