"""A Trainer's ``TrainState`` is what checkpoints save and heals send: loaded into another
Trainer, that Trainer goes on exactly as the first would have (the same losses, the same
weights, the same epoch's train_loss), from a checkpoint of this release or of an earlier
one."""

from __future__ import annotations

import json

import torch

import shoal
from shoal.checkpoint.layout import META
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

BATCH = 16
EPOCH_STEPS = 15  # N_SAMPLES // BATCH
STOP_AT = 6  # inside the first epoch


def _trainer(**settings) -> shoal.Trainer:
    model = make_model()
    scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)  # noqa: E731
    return shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                         batch_size=BATCH, lr_scheduler=scheduler, **settings)


def _same(a: shoal.Trainer, b: shoal.Trainer) -> None:
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert a.global_step == b.global_step and a.epoch == b.epoch
    assert a.lr_scheduler.get_last_lr() == b.lr_scheduler.get_last_lr()


def test_a_heals_state_continues_the_run(single_process):
    straight = _trainer()
    whole = straight.fit(make_dataset(), max_steps=EPOCH_STEPS)
    first = _trainer()
    first.fit(make_dataset(), max_steps=STOP_AT)
    assert first.state.position == STOP_AT * BATCH
    second = _trainer()
    second.state.load_state_dict(first.state.state_dict(heal=True), heal=True)
    _same(first, second)
    result = second.fit(make_dataset(), max_steps=EPOCH_STEPS)
    _same(straight, second)
    assert result["train_loss"] == whole["train_loss"]  # the whole epoch's, not since


def test_a_checkpoint_of_an_earlier_release_resumes_mid_epoch(single_process, tmp_path):
    """Earlier releases named the data position 'consumed' and kept no accumulation or
    skipped steps in the checkpoint's meta."""
    straight = _trainer()
    whole = straight.fit(make_dataset(), max_steps=EPOCH_STEPS)
    _trainer(checkpoint_dir=str(tmp_path)).fit(make_dataset(), max_steps=STOP_AT)
    meta_file = next(tmp_path.glob("step_*")) / META
    record = json.loads(meta_file.read_text())
    meta = record["meta"]
    meta["consumed"] = meta.pop("position")
    assert meta["consumed"] == STOP_AT * BATCH
    del meta["accumulate"], meta["skipped_steps"]
    meta_file.write_text(json.dumps(record))
    resumed = _trainer(checkpoint_dir=str(tmp_path), resume="auto")
    result = resumed.fit(make_dataset(), max_steps=EPOCH_STEPS)
    _same(straight, resumed)
    assert result["train_loss"] == whole["train_loss"]
