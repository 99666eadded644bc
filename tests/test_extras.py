"""shoal's extras: each optional feature, its extra missing, is one line naming the extra to
install, before any process starts where a run config asks for the feature; and the extras
that pyproject.toml declares are the ones shoal.extras knows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shoal import extras
from shoal.errors import UsageError
from tests.helpers import REPO, run_shoal_in_process

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on


def _uninstall(monkeypatch, extra: str) -> None:
    """Make ``extra``'s modules unimportable here, as if it were not installed."""
    for name in extras.EXTRAS[extra].modules:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def test_pyproject_declares_the_extras_shoal_knows_and_all_holds_them():
    project = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared)
    everything = " ".join(declared["all"])
    for extra in extras.EXTRAS:
        assert extra in everything, extra
    core = " ".join(project["dependencies"])
    for extra in extras.EXTRAS.values():  # no extra's package in the core
        for module in extra.modules:
            assert module not in core, module


@pytest.mark.parametrize("extra", sorted(extras.EXTRAS))
def test_require_is_one_line_naming_the_extra(monkeypatch, extra):
    assert extras.installed(extra)  # the test extra installs them all
    _uninstall(monkeypatch, extra)
    with pytest.raises(UsageError) as caught:
        extras.require(extra, "this feature")
    message = str(caught.value)
    assert message.startswith("this feature needs ") and "\n" not in message
    assert message.endswith(f"pip install 'shoal[{extra}]'")


def _one_line_error(out, *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr
    return out.stderr


def test_the_digits_data_without_scikit_learn(monkeypatch, tmp_path):
    _uninstall(monkeypatch, "examples")
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml", f"run.dir={tmp_path}")
    _one_line_error(out, "data.builder", "scikit-learn", "pip install 'shoal[examples]'")
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_dashboard_without_its_server(monkeypatch, tmp_path):
    _uninstall(monkeypatch, "dashboard")
    out = run_shoal_in_process("dashboard", str(tmp_path))
    _one_line_error(out, "the dashboard needs starlette and uvicorn",
                    "pip install 'shoal[dashboard]'")
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml", "--dashboard",
                               f"run.dir={tmp_path / 'run'}")
    _one_line_error(out, "--dashboard needs", "pip install 'shoal[dashboard]'")


def test_tensorboard_asked_for_without_it(monkeypatch, tmp_path):
    _uninstall(monkeypatch, "tensorboard")
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml", f"run.dir={tmp_path}",
                               "trainer.metrics.tensorboard=true")
    _one_line_error(out, "trainer.metrics.tensorboard", "pip install 'shoal[tensorboard]'")


def test_by_default_tensorboard_is_written_only_when_installed(monkeypatch, tmp_path):
    from shoal.metrics import trackers
    from shoal.metrics.recorder import MetricsConfig

    assert [type(t) for t in trackers.build(MetricsConfig(dir=str(tmp_path)))] == \
        [trackers.TensorBoard]
    assert (tmp_path / "tensorboard").is_dir()
    _uninstall(monkeypatch, "tensorboard")
    assert trackers.build(MetricsConfig(dir=str(tmp_path / "without"))) == []


def test_the_remote_tier_without_grpc(monkeypatch, tmp_path):
    _uninstall(monkeypatch, "remote")
    out = run_shoal_in_process("remote", "serve", "--module", "tests.remote.blocks:block")
    _one_line_error(out, "pip install 'shoal[remote]'")


def test_rl_without_gymnasium(monkeypatch):
    from shoal.rl.envs import check_env

    check_env.cache_clear()
    _uninstall(monkeypatch, "rl")
    with pytest.raises(UsageError, match=r"pip install 'shoal\[rl\]'"):
        check_env("CartPole-v1")
    check_env.cache_clear()
