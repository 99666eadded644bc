"""A resume path is loaded or refused: never silently ignored."""

from __future__ import annotations

import pytest
import torch

import shoal
from shoal.errors import UsageError
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer


def _trainer(**settings) -> shoal.Trainer:
    model = make_model()
    return shoal.Trainer(model, make_optimizer(model), batch_size=8, seed=SEED,
                         progress=False, **settings)


def test_a_path_without_checkpoint_dir_continues_the_run_and_writes_nothing(
        tmp_path, single_process, capsys):
    straight = _trainer()
    straight.fit(make_dataset(), max_steps=8)
    _trainer(checkpoint_dir=str(tmp_path), checkpoint_every=4).fit(make_dataset(), max_steps=4)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["step_000000004"]

    resumed = _trainer(resume=str(tmp_path / "step_000000004"))
    resumed.fit(make_dataset(), max_steps=8)
    assert resumed.global_step == 8
    a, b = straight.module.state_dict(), resumed.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == saved
    assert "no new checkpoints are written (checkpoint_dir is unset)" in capsys.readouterr().err


@pytest.mark.parametrize("name, problem", [
    ("missing", "no such directory"),
    ("empty", "no commit marker"),
    (".", "a directory of checkpoints"),
])
def test_a_path_without_a_complete_checkpoint_is_refused(tmp_path, name, problem):
    (tmp_path / "empty").mkdir()
    (tmp_path / "step_000000003").mkdir()
    with pytest.raises(UsageError, match=problem):
        shoal.TrainerConfig.build(resume=str(tmp_path / name))
