"""What the launcher knows of the entry before anything starts, without running any of it.

Two questions, both answered from files alone (no module of the user's is imported in the
launcher):

- ``find_module``: where ``python -m NAME`` would find NAME, as the worker will look: the
  working directory first (``python -m`` puts it on ``sys.path``), then ``PYTHONPATH``, then
  the interpreter's own path.
- ``trains_through_shoal``: whether the script (or the modules of the user's it imports)
  uses ``shoal.Trainer``, the only way a worker meets the other replica groups of a live
  job. A script that sets up torch.distributed itself would run
  as that many independent copies writing the same files.
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
from importlib.machinery import ModuleSpec, PathFinder
from importlib.util import find_spec

_LIVE_NAMES = frozenset({"Trainer"})
_MAX_FILES = 500  # a user's own tree; past this the answer is "not seen"


def search_path(cwd: str) -> list[str]:
    """The ``sys.path`` a worker of ``python -m`` started in ``cwd`` has."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [cwd, *extra, *sys.path]


def find_module(name: str, cwd: str) -> ModuleSpec | None:
    """The spec ``python -m name`` run in ``cwd`` would find, or None; nothing is imported
    (a dotted name's packages are looked into, not run)."""
    first, *rest = name.split(".")
    saved = sys.path[:]
    sys.path[:] = search_path(cwd)
    try:  # a top-level name is found without importing anything
        spec = find_spec(first) if first not in sys.modules else sys.modules[first].__spec__
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    for part in rest:
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = PathFinder.find_spec(f"{spec.name}.{part}", list(spec.submodule_search_locations))
    return spec


def _installed_roots() -> tuple[str, ...]:
    """Folders of the interpreter's library and installed packages: not the user's code."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    return tuple(os.path.realpath(root) + os.sep for root in roots)


class _Scan:
    """The user's modules reachable by import from the entry, read one by one."""

    def __init__(self, roots: list[str]):
        self.roots = roots  # where the entry's absolute imports are looked for
        self.installed = _installed_roots()
        self.seen: set[str] = set()
        self.todo: list[str] = []

    def add(self, path: str | None) -> None:
        if not path or not path.endswith(".py") or not os.path.isfile(path):
            return
        real = os.path.realpath(path)
        if real not in self.seen and not real.startswith(self.installed):
            self.seen.add(real)
            self.todo.append(real)

    def add_module(self, name: str, base: list[str]) -> None:
        """``name`` (dotted) found under ``base`` folders, with its packages' __init__;
        shoal's own modules are not the user's (they hold the names looked for)."""
        parts = name.split(".")
        if parts[0] == "shoal" and base is self.roots:
            return
        for folder in base:
            for depth in range(1, len(parts) + 1):
                stem = os.path.join(folder, *parts[:depth])
                self.add(os.path.join(stem, "__init__.py"))
                self.add(stem + ".py")

    def run(self) -> bool:
        while self.todo and len(self.seen) <= _MAX_FILES:
            path = self.todo.pop()
            try:
                with open(path, "rb") as f:
                    tree = ast.parse(f.read(), path)
            except (OSError, SyntaxError, ValueError):
                continue
            if _uses_live_names(tree):
                return True
            self._follow(tree, path)
        return False

    def _follow(self, tree: ast.Module, path: str) -> None:
        here = os.path.dirname(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.add_module(alias.name, self.roots)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the file's own package upward
                    base = here
                    for _ in range(node.level - 1):
                        base = os.path.dirname(base)
                    bases = [base]
                else:
                    bases = self.roots
                module = node.module or ""
                for alias in node.names:  # `from pkg import mod` imports a module too
                    self.add_module(".".join(filter(None, [module, alias.name])), bases)
                if module:
                    self.add_module(module, bases)


def _uses_live_names(tree: ast.Module) -> bool:
    """Whether the module takes the Trainer from shoal: ``from shoal import Trainer``, or
    ``shoal.Trainer`` (any alias of shoal or of a module of its)."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "shoal":
                    aliases.add(alias.asname or "shoal")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                node.module.split(".")[0] == "shoal":
            for alias in node.names:
                if alias.name in _LIVE_NAMES:
                    return True
                aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _LIVE_NAMES:
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                return True
    return False


def trains_through_shoal(entry: str, module: bool, cwd: str) -> bool:
    """Whether the script (or ``-m`` module) ``entry``, or a module of the user's it
    imports (not one of the interpreter's library or installed packages), uses
    ``shoal.Trainer``."""
    if module:
        spec = find_module(entry, cwd)
        if spec is None:
            return False
        origin = spec.origin
        if spec.submodule_search_locations:  # a package: python -m runs its __main__
            origin = os.path.join(list(spec.submodule_search_locations)[0], "__main__.py")
        scan = _Scan(search_path(cwd))
    else:
        origin = os.path.abspath(entry)
        scan = _Scan([os.path.dirname(origin), *search_path(cwd)[1:]])
    scan.add(origin)
    return scan.run()
