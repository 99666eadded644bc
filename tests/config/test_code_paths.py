"""A run config names the user's own code: modules beside the config file, then in the
current directory, then the environment; every rank imports the same files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from shoal.config.loader import load_run_config
from shoal.errors import UsageError
from shoal.imports import import_builder
from tests.helpers import run_shoal

USER_MODULES = ("mymodel", "mydata", "myloss", "shapes")

_MARK = '''
import os
if os.environ.get("MARKS"):  # which process imported which file
    open(os.path.join(os.environ["MARKS"], f"{__name__}-{os.getpid()}"), "w").close()
'''

PROJECT = {
    "shapes.py": "FEATURES, CLASSES = 8, 3\n",
    "mymodel.py": _MARK + '''
import torch
from shapes import CLASSES, FEATURES  # a sibling module, found the same way


def build(hidden: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, CLASSES))
''',
    "mydata.py": _MARK + '''
import torch
from shapes import CLASSES, FEATURES


def build(n: int = 96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.Subset(data, range(64)), torch.utils.data.Subset(data, range(64, n))
''',
    "myloss.py": _MARK + '''
import torch


def build(smoothing: float = 0.0):
    return torch.nn.CrossEntropyLoss(label_smoothing=smoothing)
''',
    "run.yaml": '''
model: {builder: "mymodel:build", args: {hidden: 16}}
data: {builder: "mydata:build"}
optimizer: {builder: "torch.optim:SGD", args: {lr: 0.1}}
loss: {builder: "myloss:build", args: {smoothing: 0.1}}
trainer: {batch_size: 8, epochs: 2, progress: false, seed: 0}
''',
}


def write_project(root: Path) -> Path:
    """A user's directory: run.yaml and the model, data and loss modules it names."""
    root.mkdir(parents=True)
    for name, text in PROJECT.items():
        (root / name).write_text(text)
    return root / "run.yaml"


def imported_by(marks: Path, module: str) -> set[int]:
    return {int(p.name.rpartition("-")[2]) for p in marks.glob(f"{module}-*")}


@pytest.fixture
def fresh_imports(monkeypatch):
    """sys.path and the user's modules as they were, after each in-process load."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in (*USER_MODULES, "shadow", "tool"):
        sys.modules.pop(name, None)


def test_two_processes_import_the_configs_own_modules_from_another_directory(tmp_path):
    config = write_project(tmp_path / "project")
    elsewhere, marks = tmp_path / "elsewhere", tmp_path / "marks"
    elsewhere.mkdir()
    marks.mkdir()
    out = run_shoal("train", "--config", str(config), "--nproc-per-node", "2",
                    f"run.dir={tmp_path / 'run'}", cwd=str(elsewhere),
                    env={"MARKS": str(marks)})
    assert out.returncode == 0, out.stderr[-3000:]
    # The launcher checks the builders, then each of the two workers builds from them.
    for module in ("mymodel", "mydata", "myloss"):
        assert len(imported_by(marks, module)) == 3, (module, sorted(marks.iterdir()))
    # The same run with the directory given the old way (PYTHONPATH) trains the same.
    reference = run_shoal("train", "--config", str(config), "--nproc-per-node", "2",
                          f"run.dir={tmp_path / 'reference'}", "run.code_paths=[]",
                          cwd=str(elsewhere),
                          env={"PYTHONPATH": os.pathsep.join([str(config.parent),
                                                              os.environ.get("PYTHONPATH", "")])})
    assert reference.returncode == 0, reference.stderr[-3000:]
    a = json.loads((tmp_path / "run" / "metrics.json").read_text())
    b = json.loads((tmp_path / "reference" / "metrics.json").read_text())
    for key in ("train_loss", "val_loss", "val_accuracy", "global_step"):
        assert a[key] == b[key], key


def test_config_directory_first_then_current_directory(tmp_path, monkeypatch, fresh_imports):
    config = write_project(tmp_path / "project")
    (tmp_path / "project" / "shadow.py").write_text("def build(**kw):\n    return 'config'\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "shadow.py").write_text("def build(**kw):\n    return 'cwd'\n")
    (cwd / "tool.py").write_text("def build(**kw):\n    return 'cwd'\n")
    monkeypatch.chdir(cwd)
    loaded = load_run_config(config, [f"run.dir={tmp_path / 'run'}"])
    assert loaded.run.code_paths == [str(config.parent.resolve()), str(cwd.resolve())]
    assert import_builder("shadow:build", "x")() == "config"
    assert import_builder("tool:build", "x")() == "cwd"  # only in the current directory


def test_code_paths_relative_to_the_config_and_kept_by_the_resolved_copy(tmp_path,
                                                                         fresh_imports):
    from shoal.config.loader import save_run_config

    config = write_project(tmp_path / "project")
    lib = tmp_path / "project" / "lib"
    lib.mkdir()
    for name in ("mymodel.py", "shapes.py"):
        (tmp_path / "project" / name).rename(lib / name)
    with pytest.raises(UsageError, match="no module named 'mymodel'"):
        load_run_config(config, ["run.code_paths=[]"])
    loaded = load_run_config(config, ["run.code_paths=[lib, .]", f"run.dir={tmp_path / 'r'}"])
    assert loaded.run.code_paths == [str(lib.resolve()), str(config.parent.resolve())]
    # A worker reads the saved copy from the run directory: the same places, verbatim.
    assert load_run_config(save_run_config(loaded)).run.code_paths == loaded.run.code_paths


@pytest.mark.parametrize("override, message", [
    ("model.builder=mymodel:biuld",
     "model.builder: 'mymodel' has no attribute 'biuld' (did you mean 'build'?)"),
    ("loss.builder=mylos:build",
     "loss.builder: cannot import 'mylos:build': no module named 'mylos' "
     "(did you mean 'myloss'?); looked in {project}, {cwd}, "),
    ("model.builder=shoal.exmples.digits:build_model",
     "no module named 'shoal.exmples' (did you mean 'shoal.examples'?)"),
    ("model.builder=torch.nn:Linaer", "'torch.nn' has no attribute 'Linaer' "
     "(did you mean 'Linear'?)"),
])
def test_a_name_that_does_not_import_says_where_it_looked(tmp_path, monkeypatch, fresh_imports,
                                                          override, message):
    config = write_project(tmp_path / "project")
    monkeypatch.chdir(tmp_path)
    expected = message.format(project=config.parent.resolve(), cwd=tmp_path.resolve())
    with pytest.raises(UsageError) as caught:
        load_run_config(config, [override])
    assert expected in str(caught.value)
    if "looked in" in expected:
        assert str(caught.value).endswith("add a directory with PYTHONPATH=DIR")


def test_a_missing_dependency_of_the_users_module_is_named(tmp_path, fresh_imports):
    config = write_project(tmp_path / "project")
    (tmp_path / "project" / "mymodel.py").write_text("import not_installed_pkg\n")
    with pytest.raises(UsageError, match="cannot import 'mymodel:build': it imports "
                                         "'not_installed_pkg', which is not installed"):
        load_run_config(config)


def test_the_command_reports_a_typo_in_one_line(tmp_path):
    config = write_project(tmp_path / "project")
    out = run_shoal("train", "--config", str(config), "model.builder=mymodel:biuld",
                    cwd=str(tmp_path))
    assert out.returncode == 2
    assert out.stderr == ("shoal train: error: model.builder: 'mymodel' has no attribute "
                          "'biuld' (did you mean 'build'?)\n")


def test_an_rl_environment_registered_by_a_module_beside_the_config(tmp_path, fresh_imports):
    import gymnasium

    project = tmp_path / "project"
    project.mkdir()
    (project / "myenvs.py").write_text(
        "import gymnasium\n"
        "gymnasium.register('BesideCart-v0', "
        "entry_point='gymnasium.envs.classic_control:CartPoleEnv', max_episode_steps=50)\n")
    config = project / "rl.yaml"
    config.write_text("rl: {env: 'myenvs:BesideCart-v0', num_envs: 2, total_steps: 512}\n")
    try:
        assert load_run_config(config).rl.env == "myenvs:BesideCart-v0"
        with pytest.raises(UsageError, match="no module named 'myenv' "
                                             r"\(did you mean 'myenvs'\?\); looked in"):
            load_run_config(config, ["rl.env=myenv:BesideCart-v0"])
    finally:
        gymnasium.registry.pop("BesideCart-v0", None)
        sys.modules.pop("myenvs", None)
