"""The checks that read the source: mypy passes on shoal's source at the strictness
pyproject.toml states ([tool.mypy]: every module checked, the public modules fully
annotated), with the pinned mypy (constraints.txt); ruff passes on the repository
([tool.ruff])."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.timeout(600)  # a hang guard: mypy checks src/shoal in about 26 s of one core
def test_mypy_passes_on_the_source():
    pytest.importorskip("mypy", reason="needs the test extra's mypy (Python 3.11 on)")
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True,
                         text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "no issues found" in out.stdout, out.stdout


@pytest.mark.timeout(120)  # a hang guard: ruff takes well under a second
def test_ruff_passes_on_the_repository():
    pytest.importorskip("ruff", reason="needs the test extra's ruff")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
