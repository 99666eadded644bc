"""The documentation site builds with no broken link, anchor or reference (``mkdocs build
--strict``), and its API page holds every public name, each with a docstring."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shoal
import shoal.remote
from tests.helpers import REPO

pytest.importorskip("mkdocstrings", reason="needs shoal[docs] (the test extra has it)")

API = Path(REPO) / "docs" / "api.md"


def _documented() -> dict[str, str]:
    """Each name the API page renders (``::: module.name``), by its short name."""
    paths = re.findall(r"^::: (\S+)$", API.read_text(), flags=re.MULTILINE)
    return {path.rsplit(".", 1)[1]: path for path in paths}


def test_the_site_builds_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120,  # a hang guard: it builds in about 3 s
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    page = (tmp_path / "api" / "index.html").read_text()
    for path in _documented().values():
        assert f'id="{path}"' in page, f"{path} has no entry on the API page"


@pytest.mark.parametrize("package", [shoal, shoal.remote], ids=lambda p: p.__name__)
def test_every_public_name_is_on_the_api_page_with_a_docstring(package):
    documented = _documented()
    for name in package.__all__:
        assert name in documented, f"{package.__name__}.{name} is not in docs/api.md"
        module, _, attr = documented[name].rpartition(".")
        target = getattr(importlib.import_module(module), attr)
        assert target is getattr(package, name), (name, documented[name])
        assert (target.__doc__ or "").strip(), f"{documented[name]} has no docstring"
