"""Run configs: overrides are typed, defaults resolved, and the saved config reloads equal."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from shoal.config.loader import apply_override, load_run_config, save_run_config
from shoal.errors import UsageError
from shoal.training.config import TrainerConfig
from tests.helpers import REPO

DIGITS = f"{REPO}/examples/digits.yaml"


def test_override_values_are_read_as_yaml():
    tree = {"trainer": {"epochs": 1}}
    for assignment in ("trainer.epochs=5", "trainer.clip_grad_norm=1e-1",
                       "trainer.progress=false", "optimizer.args.betas=[0.9, 0.95]",
                       "run.dir=runs/x"):
        apply_override(tree, assignment)
    assert tree == {"trainer": {"epochs": 5, "clip_grad_norm": 0.1, "progress": False},
                    "optimizer": {"args": {"betas": [0.9, 0.95]}}, "run": {"dir": "runs/x"}}
    with pytest.raises(UsageError, match="key.sub=value"):
        apply_override(tree, "trainer.epochs")
    with pytest.raises(UsageError, match="not a section"):
        apply_override(tree, "run.dir.sub=1")


def test_digits_config_resolves_and_round_trips(tmp_path):
    config = load_run_config(DIGITS, [f"run.dir={tmp_path}/run", "trainer.epochs=3",
                                      "trainer.precision=bf16-mixed"])
    assert config.trainer.epochs == 3 and config.trainer.precision == "bf16-mixed"
    saved = save_run_config(config)
    assert saved == tmp_path / "run" / "config.yaml"
    assert load_run_config(saved) == config
    assert yaml.safe_load(saved.read_text())["trainer"]["epochs"] == 3


def test_run_dir_defaults_to_config_name(tmp_path):
    source = yaml.safe_load(open(DIGITS))
    del source["run"]["dir"]
    path = tmp_path / "mnistish.yaml"
    path.write_text(yaml.safe_dump(source))
    assert load_run_config(path).run.dir == "runs/mnistish"


def test_trainer_settings_are_validated_in_python_too():
    with pytest.raises(UsageError, match=r"trainer\.precision"):
        TrainerConfig.build(precision="fp8")
    with pytest.raises(UsageError, match=r"trainer\.accumulate_grad_batches"):
        TrainerConfig.build(accumulate_grad_batches=0)
    with pytest.raises(UsageError, match=r"trainer\.batchsize: unknown key"):
        TrainerConfig.build(batchsize=3)
    assert TrainerConfig.build(precision=32).precision == "32"


def test_reading_a_run_config_imports_no_checkpoint_or_sharding_engine():
    """`shoal train`'s launcher validates the run config; DCP, DTensor and FSDP (with sympy,
    about 0.8 s of imports) are the workers' business."""
    code = ("import sys; from shoal.config.loader import load_run_config; "
            "load_run_config('examples/gpt.yaml'); "
            "print([m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', "
            "'torch.distributed.fsdp', 'sympy', 'shoal.checkpoint.store') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)  # a hang guard: about 3 s
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"], out.stdout
