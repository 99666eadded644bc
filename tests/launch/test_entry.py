"""What the launcher reads of the entry before anything starts: where ``python -m`` finds a
module, and whether a script trains through shoal.Trainer (live mode's groups meet only
there); nothing of the user's is imported."""

from __future__ import annotations

import sys

import pytest

from shoal.launch.entry import find_module, trains_through_shoal


def _write(folder, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_module_is_found_in_the_working_folder_without_importing_it(tmp_path):
    # A package whose import would fail: found all the same, since nothing is run.
    _write(tmp_path, {"mine.py": "", "pkg/__init__.py": "raise SystemExit('imported')",
                      "pkg/train.py": ""})
    assert find_module("mine", str(tmp_path)).origin == str(tmp_path / "mine.py")
    assert find_module("pkg.train", str(tmp_path)).origin == str(tmp_path / "pkg/train.py")
    assert find_module("pkg.missing", str(tmp_path)) is None
    assert find_module("mine.sub", str(tmp_path)) is None  # not a package
    assert find_module("no_such_module_xyz", str(tmp_path)) is None
    assert find_module("json.tool", str(tmp_path)) is not None  # the standard library's
    assert "pkg" not in sys.modules


@pytest.mark.parametrize("source, trains", [
    ("from shoal import Trainer\nTrainer(model, opt)\n", True),
    ("import shoal\nshoal.Trainer(model, opt).fit(data)\n", True),
    ("import shoal as sh\nt = sh.Trainer(model, opt)\n", True),
    ("from shoal.training import trainer\ntrainer.Trainer(model, opt)\n", True),
    ("from shoal.training.trainer import Trainer as T\n", True),
    # the Harness alone has no live session: its own loop meets no other group
    ("import shoal\nh = shoal.Harness(model, opt)\n", False),
    # a torchrun script, and one that takes only shoal's helpers
    ("import torch.distributed as dist\ndist.init_process_group('gloo')\n", False),
    ("import shoal\nshoal.init()\nprint(shoal.rank())\n", False),
    ("class Trainer:\n    pass\nTrainer()\n", False),
    ("import os\nos.Trainer = 1\n", False),
])
def test_a_script_trains_through_shoal_when_it_uses_the_trainer(
        tmp_path, source, trains):
    _write(tmp_path, {"train.py": source})
    assert trains_through_shoal(str(tmp_path / "train.py"), False, str(tmp_path)) is trains


def test_the_modules_of_the_users_a_script_imports_are_read_too(tmp_path):
    _write(tmp_path, {
        "job/train.py": "from lib.loop import fit\nfit()\n",
        "job/lib/__init__.py": "",
        "job/lib/loop.py": "from .build import make\n",
        "job/lib/build.py": "import shoal\ndef make():\n    return shoal.Trainer\n",
        "other/train.py": "import lib.loop\n",  # no lib beside it: nothing found
        "pkg/__init__.py": "",
        "pkg/__main__.py": "from . import run\n",
        "pkg/run.py": "from shoal import Trainer\n",
    })
    assert trains_through_shoal(str(tmp_path / "job/train.py"), False, str(tmp_path))
    assert not trains_through_shoal(str(tmp_path / "other/train.py"), False, str(tmp_path))
    assert trains_through_shoal("pkg", True, str(tmp_path))  # python -m pkg runs __main__
    assert trains_through_shoal("pkg.run", True, str(tmp_path))
    assert not trains_through_shoal("no_such_module_xyz", True, str(tmp_path))


def test_a_script_that_cannot_be_parsed_is_not_taken_for_a_trainer(tmp_path):
    _write(tmp_path, {"train.py": "def broken(:\n"})
    assert not trains_through_shoal(str(tmp_path / "train.py"), False, str(tmp_path))
