"""When a Trainer writes a checkpoint: a step done again bitwise (a live replacement
redoing its group's steps) is written only where no complete checkpoint of it is there; the
run's last step once, after the final validation, so that it holds the final metrics."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("run", [
    {"epochs": 2},  # the last step saved at the end, after the last validation
    {"epochs": 2, "checkpoint_every": 5},  # ... also where a periodic save falls on it
    {"max_steps": 10, "checkpoint_every": 5},  # ... and where max_steps ends it mid-epoch
])
def test_a_run_resumed_when_it_had_finished_returns_its_final_metrics(
        single_process, tmp_path, run):
    """A restart after the last step (a kill during teardown) resumes from the final
    checkpoint and has nothing to train: fit returns the finished run's final metrics, the
    same to the bit (before: only {'global_step': N}, written over the run's metrics.json)."""
    def fit() -> tuple[dict, shoal.Trainer]:
        model = make_model()
        trainer = shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                                batch_size=48, checkpoint_dir=str(tmp_path), resume="auto",
                                **{k: v for k, v in run.items() if k != "max_steps"})
        return trainer.fit(make_dataset(), make_dataset(48), max_steps=run.get("max_steps")), \
            trainer

    finished, first = fit()
    assert "val_loss" in finished and finished["global_step"] == first.global_step
    again, second = fit()
    assert again == finished
    assert second.history == first.history and second.global_step == first.global_step
