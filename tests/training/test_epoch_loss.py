"""An epoch resumed from a checkpoint saved inside it reports the train_loss of the epoch
without the stop: bitwise on the same processes; on another number of them, as close as
the training itself then is."""

from __future__ import annotations

import pytest

import shoal
from tests.training.reference import N_SAMPLES, SEED, make_dataset, make_model, make_optimizer

GLOBAL_BATCH = 16
EPOCH_STEPS = N_SAMPLES // GLOBAL_BATCH  # 15
STOP_AT = 6  # inside the first epoch


def _fit(directory: str | None, max_steps: int) -> tuple[int, float]:
    """(global step, train_loss) of a fit to ``max_steps``; with ``directory``, resumed
    from its newest checkpoint, and a checkpoint saved there at the end."""
    shoal.init("gloo")
    model = make_model()
    settings = {"checkpoint_dir": directory, "resume": "auto"} if directory else {}
    trainer = shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                            batch_size=GLOBAL_BATCH // shoal.world_size(), **settings)
    result = trainer.fit(make_dataset(), max_steps=max_steps)
    return trainer.global_step, result["train_loss"]


@pytest.mark.parametrize("resumed_on", [2, 1])
def test_a_resumed_epoch_reports_the_whole_epochs_train_loss(tmp_path, resumed_on):
    straight = shoal.spawn(_fit, nprocs=2, args=(None, EPOCH_STEPS))
    stopped = shoal.spawn(_fit, nprocs=2, args=(str(tmp_path), STOP_AT))
    resumed = shoal.spawn(_fit, nprocs=resumed_on, args=(str(tmp_path), EPOCH_STEPS))
    assert stopped[0][0] == STOP_AT and resumed[0][0] == EPOCH_STEPS
    # The first part's figure covers its own steps only: a check that the test can fail.
    assert stopped[0][1] != straight[0][1]
    if resumed_on == 2:
        assert [r[1] for r in resumed] == [straight[0][1]] * 2
    else:  # one process's mean over 16 samples rounds otherwise than two over 8 each:
        # the training after the resume differs in the last bits, not the bookkeeping
        assert resumed[0][1] == pytest.approx(straight[0][1], rel=1e-6)


def test_a_live_steps_losses_are_what_plain_adds_give():
    """In a live step the losses are kept apart (``mark``) and the step's sum over the
    groups is added at its end (``take_step``); one group's own sum added so gives bitwise
    the sums of plain adds, a step that does not commit (``rewind``) adds nothing, and
    ``step_sum`` counts the loss still to come."""
    import torch

    from shoal.training.epoch_loss import EpochLoss

    generator = torch.Generator().manual_seed(SEED)
    steps = [[torch.rand((), generator=generator) * 10 for _ in range(k)] for k in (1, 3, 2)]
    plain, live = EpochLoss(torch.device("cpu")), EpochLoss(torch.device("cpu"))
    for losses in steps:
        for loss in losses:
            plain.add(loss)
        live.mark()  # a step that does not commit first
        for loss in losses:
            live.add(loss)
        live.rewind()
        live.mark()  # then done again
        for loss in losses[:-1]:
            live.add(loss)
        total, batches = live.step_sum(coming=losses[-1])
        live.add(losses[-1])
        assert (total, batches) == live.step_sum()
        live.take_step(total, batches)
    assert plain.state() == live.state()
    assert live.state()[1] == 6 and live.state()[0] > 0
