"""Non-finite guard: a NaN loss on one rank skips the step on every rank, or stops naming it;
a model holding NaN is never checkpointed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shoal
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

POISONED_STEP = 3


def _poisoned_loss(trainer_box):
    def loss_fn(out, target):
        loss = F.cross_entropy(out, target)
        trainer = trainer_box[0]
        if shoal.rank() == 1 and trainer.global_step + 1 == POISONED_STEP:
            return loss * float("nan")
        return loss
    return loss_fn


def _train(mode: str):
    shoal.init("gloo")
    box = []
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=8, seed=SEED,
                            loss_fn=_poisoned_loss(box), nonfinite=mode, progress=False)
    box.append(trainer)
    trainer.fit(make_dataset(), max_steps=6)
    weights = torch.cat([p.detach().flatten() for p in trainer.module.parameters()])
    return trainer.skipped_steps, weights


def test_skip_skips_the_same_step_everywhere():
    results = shoal.spawn(_train, nprocs=2, args=("skip",))
    assert [r[0] for r in results] == [[POISONED_STEP], [POISONED_STEP]]
    assert torch.isfinite(results[0][1]).all()
    assert torch.equal(results[0][1], results[1][1])


def test_stop_names_the_step_and_the_rank():
    with pytest.raises(shoal.WorkerFailedError) as info:
        shoal.spawn(_train, nprocs=2, args=("stop",))
    assert f"non-finite gradients at step {POISONED_STEP}" in str(info.value)
    assert "loss not finite on rank 1" in str(info.value)


def test_a_nan_model_is_not_saved(tmp_path, single_process, capsys):
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), progress=False,
                            checkpoint_dir=str(tmp_path), checkpoint_every=2)
    trainer.fit(make_dataset(), max_steps=2)
    with torch.no_grad():
        next(trainer.module.parameters()).fill_(float("nan"))
    assert trainer.checkpointing.save() is None
    assert "not saving step 2" in capsys.readouterr().err
    assert trainer.checkpointing.store.latest().name == "step_000000002"
