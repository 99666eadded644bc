"""Tests of the scripts in benchmarks/, which are files, not a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from tests.helpers import REPO

BENCHMARKS = Path(REPO) / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, run as a module (with benchmarks/ importable while it
    runs: groups.py imports recovery.py's readers)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))
