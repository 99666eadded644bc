"""The documentation site builds with no broken link, anchor or reference (``mkdocs build
--strict``), and its API page holds every public name, each with a docstring that says what
it raises."""

from __future__ import annotations

import importlib
import inspect
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
# What a docstring of the API page says about errors: a Google-style section, or the sentence
# of a function that raises nothing on purpose.
RAISES = ("Raises:", "Never raises.")


def _documented() -> dict[str, str]:
    """Each name the API page renders (``::: module.name``), by its short name."""
    paths = re.findall(r"^::: (\S+)$", API.read_text(), flags=re.MULTILINE)
    return {path.rsplit(".", 1)[1]: path for path in paths}


def _entries() -> list[tuple[str, list[str] | None]]:
    """Each entry of the API page (``::: module.name`` and its indented options) with its
    ``members:`` option: the names listed, [] for ``false``, None when unset or ``true``
    (mkdocstrings' default)."""
    entries = []
    for match in re.finditer(r"^::: (\S+)$((?:\n[ \t]+\S.*)*)", API.read_text(),
                             flags=re.MULTILINE):
        option = re.search(r"^\s+members:\s*(.+?)\s*$", match[2], flags=re.MULTILINE)
        value = option[1] if option else "true"
        members = {"true": None, "false": []}.get(value, re.findall(r"\w+", value))
        entries.append((match[1], members))
    return entries


def _rendered_methods(cls: type, members: list[str] | None) -> list[str]:
    """The methods the page renders under ``cls``: those ``members`` lists, or by default
    each public one the class defines with a docstring."""
    if members is not None:
        return members
    return [name for name, value in vars(cls).items()
            if inspect.isfunction(getattr(value, "__func__", value)) and value.__doc__
            and not re.match(r"_[^_]", name)]


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


def test_every_api_entry_says_what_it_raises():
    # A function; a class other than an exception (its docstring or its __init__'s, and each
    # method the entry renders). An exception's docstring says who raises it instead.
    missing = []
    for path, members in _entries():
        module, _, attr = path.rpartition(".")
        target = getattr(importlib.import_module(module), attr)
        if isinstance(target, type) and issubclass(target, BaseException):
            continue
        docs = {path: [target.__doc__]}
        if isinstance(target, type):
            docs[path].append(getattr(vars(target).get("__init__"), "__doc__", None))
            for name in _rendered_methods(target, members):
                docs[f"{path}.{name}"] = [getattr(target, name).__doc__]
        missing += [where for where, texts in docs.items()
                    if not any(mark in (text or "") for text in texts for mark in RAISES)]
    assert not missing, (f"no {' or '.join(map(repr, RAISES))} in the docstring of: "
                         + ", ".join(missing))
