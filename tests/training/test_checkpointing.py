"""When a Trainer writes a checkpoint: a step done again bitwise (a live replacement
redoing its group's steps) is written only where no complete checkpoint of it is there."""

from __future__ import annotations

import shoal
from shoal.checkpoint.layout import COMMIT
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

STEPS = 4


def test_a_redone_step_is_written_only_where_its_checkpoint_is_incomplete(single_process,
                                                                          tmp_path):
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                            batch_size=16, checkpoint_dir=str(tmp_path), checkpoint_every=1,
                            keep_last=STEPS)
    trainer.fit(make_dataset(), max_steps=STEPS)
    checkpointing = trainer.checkpointing
    marker = {step: checkpointing.store.path_for(step) / COMMIT for step in (2, 3)}
    before = marker[2].stat().st_mtime_ns
    marker[3].unlink()  # step 3's writer died before it completed it
    for step in (2, 3):
        trainer.state.global_step = step
        checkpointing.after_step(redone=True)
        assert checkpointing.saved_step == step
    assert marker[2].stat().st_mtime_ns == before  # complete: not written again
    assert marker[3].exists()  # written again, whole
    assert checkpointing.store.problem(checkpointing.store.path_for(3)) is None
