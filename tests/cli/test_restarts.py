"""A job that restarts its workers never trains from scratch without saying so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shoal.cli.train import _resume_on_restart
from shoal.config.loader import load_run_config
from tests.helpers import REPO

DIGITS = f"{REPO}/examples/digits.yaml"


def _spec(max_restarts=0, min_nodes=None, nnodes=1):
    return SimpleNamespace(max_restarts=max_restarts, min_nodes=min_nodes, nnodes=nnodes)


@pytest.mark.parametrize("spec, why", [(_spec(max_restarts=2), "--max-restarts 2"),
                                       (_spec(min_nodes=1, nnodes=2), "--nnodes 1:2")])
def test_restarts_with_checkpoints_imply_resume_auto(tmp_path, capsys, spec, why):
    config = load_run_config(DIGITS, [f"trainer.checkpoint_dir={tmp_path}"])
    assert _resume_on_restart(config, spec, rl=False, first=True) == ["trainer.resume=auto"]
    assert config.trainer.resume == "auto"
    assert capsys.readouterr().err == (
        f"shoal: {why}: a restarted worker continues from the newest checkpoint in "
        f"{tmp_path} (trainer.resume=auto implied; set trainer.resume to choose otherwise)\n")


def test_restarts_without_checkpoints_are_said_to_start_over(capsys):
    config = load_run_config(DIGITS)
    assert _resume_on_restart(config, _spec(max_restarts=1), rl=False, first=True) == []
    assert config.trainer.resume is None
    assert "without trainer.checkpoint_dir: a restarted worker starts the run over from " \
        "step 0" in capsys.readouterr().err


def test_a_resume_setting_or_no_restarts_is_left_alone(tmp_path, capsys):
    config = load_run_config(DIGITS, [f"trainer.checkpoint_dir={tmp_path}"])
    assert _resume_on_restart(config, _spec(), rl=False, first=True) == []
    config = load_run_config(DIGITS, [f"trainer.checkpoint_dir={tmp_path}",
                                      "trainer.resume=auto"])
    assert _resume_on_restart(config, _spec(max_restarts=3), rl=False, first=True) == []
    assert capsys.readouterr().err == ""
