"""Bad input to `shoal rl` and rl: run configs: one line, exit 2, before any worker starts."""

from __future__ import annotations

import pytest

from shoal.cli.main import main


def _refused(capsys, *argv: str) -> str:
    assert main(["rl", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_unknown_environment_names_the_closest_ids(capsys):
    err = _refused(capsys, "--env", "CartPol-v1")
    assert "rl.env: unknown environment 'CartPol-v1'" in err
    assert "CartPole-v1" in err


def test_action_space_the_learner_cannot_handle(capsys):
    err = _refused(capsys, "--env", "tests.rl.envs:SwitchBoard-v0")
    assert "MultiBinary(4)" in err and "Discrete and one-dimensional Box" in err


@pytest.mark.parametrize("settings, words", [
    (["num_envs=3", "num_steps=10", "num_minibatches=4"], "30 samples per rank"),
    (["num_envs=4", "num_steps=8", "num_minibatches=4", "accumulate=3"], "12 equal parts"),
    (["learning_rate=-1"], "rl.learning_rate"),
    (["num_env=4"], "rl.num_env: unknown key"),
    (["checkpoint_every=5"], "need checkpoint_dir"),
    (["resume=/nonexistent/step_000000004"], "no such directory"),
])
def test_settings_that_do_not_fit(capsys, settings, words):
    assert words in _refused(capsys, "--env", "CartPole-v1", *settings)


def test_too_few_steps_for_one_update_at_this_world_size(capsys):
    err = _refused(capsys, "--env", "CartPole-v1", "--nproc-per-node", "2",
                   "--total-steps", "300")
    assert "less than one update's global batch of 512" in err


def test_the_run_config_form_is_checked_the_same(tmp_path, capsys):
    config = tmp_path / "rl.yaml"
    config.write_text("rl:\n  env: Pendulum\n")
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "unknown environment 'Pendulum'" in err and "Pendulum-v1" in err
