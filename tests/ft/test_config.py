"""Live-recovery settings are refused in one line when they cannot work."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from shoal.cli.run import live_settings, register, spec_from_args
from shoal.errors import UsageError
from shoal.ft import FaultToleranceConfig, ReplicaPlace
from shoal.ft.engine import check_available
from tests.helpers import run_shoal


def _flags(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"ft_mode": None, "replica_groups": None, "ft_policy": None,
                                 "lighthouse": None, "ft_step_timeout": None,
                                 "ft_replacement_timeout": None, **given})


def test_timeouts_must_be_ordered():
    with pytest.raises(UsageError, match="heartbeat_timeout_ms 20000 must be shorter than "
                                         "step_timeout_s 10"):
        FaultToleranceConfig.build(heartbeat_timeout_ms=20000)
    with pytest.raises(UsageError, match="step_timeout_s 200.0 must be shorter than "
                                         "replacement_timeout_s 120"):
        FaultToleranceConfig.build(step_timeout_s=200)


def test_replica_groups_choose_live_mode_and_the_flags_win():
    config = live_settings(_flags(replica_groups=3, ft_policy="available"),
                           FaultToleranceConfig(step_timeout_s=5))
    assert (config.mode, config.replica_groups, config.policy, config.step_timeout_s) == (
        "live", 3, "available", 5)
    assert live_settings(_flags()) is None  # today's restart stays the default


def test_a_trainer_sets_what_only_the_workers_read():
    """The launcher's settings win, said in a line where the Trainer's own
    ``fault_tolerance`` sets them otherwise, except those only workers read, which the
    Trainer's sets."""
    launcher = FaultToleranceConfig(mode="live", step_timeout_s=5, compression_state_every=7)
    own = FaultToleranceConfig(step_timeout_s=3, compression_state_every=4)
    assert launcher.with_workers_own(own).model_dump() == {
        **launcher.model_dump(), "compression_state_every": 4}
    assert launcher.with_workers_own(FaultToleranceConfig()) == launcher  # none set
    assert launcher.overruled(own) == (
        "the Trainer's fault_tolerance sets step_timeout_s 3.0 (runs with 5.0): the "
        "launcher's settings win (its flags, or the run config's trainer.fault_tolerance)")
    assert launcher.overruled(FaultToleranceConfig(mode="live", step_timeout_s=5)) is None


@pytest.mark.parametrize("flags, message", [
    (_flags(ft_policy="exact"), "--ft-policy, --lighthouse and --ft-\\*-timeout are "
                                "settings of live mode"),
    (_flags(ft_step_timeout=2.0), "are settings of live mode: add --ft-mode live"),
    (_flags(replica_groups=2, ft_step_timeout=5, ft_replacement_timeout=5),
     "step_timeout_s 5.0 must be shorter than replacement_timeout_s 5.0"),
    (_flags(replica_groups=1), "live mode needs at least 2 replica groups"),
])
def test_live_flags_that_cannot_work_are_refused(flags, message):
    with pytest.raises(UsageError, match=message):
        live_settings(flags)


def _spec(*argv: str):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    # any module that trains through the Trainer (live mode refuses one that does not)
    args = parser.parse_args(["run", *argv, "-m", "shoal.launch.train_entry"])
    return spec_from_args(args, args.entry, args.args, args.module)


def test_the_timeout_flags_reach_the_config_and_set_a_live_hang_timeout():
    spec = _spec("--replica-groups", "2", "--ft-step-timeout", "2",
                 "--ft-replacement-timeout", "30")
    c = spec.fault_tolerance
    assert (c.step_timeout_s, c.replacement_timeout_s) == (2, 30)
    assert spec.hang_timeout == 15  # half the replacement timeout, unless given
    assert _spec("--replica-groups", "2", "--hang-timeout", "7").hang_timeout == 7
    assert _spec("--replica-groups", "2", "--hang-timeout", "0").hang_timeout is None
    assert _spec().hang_timeout == 600  # a job without replica groups keeps its default


def test_a_place_round_trips_through_the_environment():
    place = ReplicaPlace(1, 2, "http://127.0.0.1:1234",
                         FaultToleranceConfig(mode="live", replica_groups=2), "127.0.0.1")
    assert ReplicaPlace.from_environ(place.environ()) == place
    assert ReplicaPlace.from_environ({}) is None


def test_live_mode_without_the_launcher_is_one_line(single_process):
    import shoal

    model = torch.nn.Linear(4, 2)
    trainer = shoal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            progress=False, fault_tolerance={"mode": "live"})
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    with pytest.raises(UsageError, match="fault_tolerance.mode 'live' needs shoal's launcher"):
        trainer.fit(data)


def test_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(UsageError, match=r"live recovery needs torchft: pip install "
                                         r"'shoal\[ft\]'"):
        check_available()


@pytest.mark.timeout(600)
def test_shoal_train_says_nothing_of_settings_nobody_gave(tmp_path):
    """`--replica-groups` over a run config without a fault_tolerance section: the workers'
    Trainer reports no conflict (its defaults are not settings of its own)."""
    pytest.importorskip("torchft")
    out = run_shoal("train", "--config", "examples/digits.yaml", "--replica-groups", "2",
                    "trainer.max_steps=2", "trainer.epochs=1", f"run.dir={tmp_path}",
                    timeout=540)  # a hang guard: the job takes about 20 s
    assert out.returncode == 0, out.stderr[-3000:]
    assert "live mode: 2 replica groups" in out.stderr + out.stdout
    assert "fault_tolerance sets" not in out.stderr + out.stdout, out.stderr
