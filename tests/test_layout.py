"""The source's layout rules that a reader relies on: no two modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The shoal modules ``path`` imports, anywhere in it (TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            # "from package import module" runs the package's __init__ first, but that is
            # no use of it: only the module counts then.
            found.update(submodules or {node.module})
    return {name for name in found if name in modules}


def test_no_two_modules_import_each_other():
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}
    mutual = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                     if a in graph.get(b, set())})
    assert not mutual, mutual


def test_every_top_level_name_resolves():
    import shoal

    for name in shoal.__all__:
        assert getattr(shoal, name) is not None, name
