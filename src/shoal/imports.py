"""Import what a run config names as 'package.module:attr' (builders, plugins, environments).

A user keeps their model next to their config, so names are looked up first in the config
file's directory, then in the current directory, then in the environment (PYTHONPATH and
installed packages). The loader resolves those two directories once, at the edge, and
stores them in the resolved config (``run.code_paths``), so every rank, every node and a
restarted worker search the same places whatever directory they start in.

Kept apart from the loader so that a feature (the remote tier) can import user code without
importing the config layer that collects the features' settings.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from shoal.errors import UsageError
from shoal.extras import extra_of, install_line, require


def default_code_paths(config_file: str | Path | None) -> list[str]:
    """The config file's directory, then the current directory, as absolute paths."""
    paths = [Path(config_file).resolve().parent] if config_file is not None else []
    paths.append(Path.cwd().resolve())
    return list(dict.fromkeys(str(path) for path in paths))


def use_code_paths(paths: Iterable[str]) -> None:
    """Put ``paths`` first on sys.path, in order, each once. Processes started from this one
    by multiprocessing (data-loader workers) inherit sys.path."""
    paths = [str(path) for path in paths]
    sys.path[:] = paths + [entry for entry in sys.path if entry not in paths]


class BuilderSpec(BaseModel):
    """A function (or class) named by import path, called with ``args`` to build an object
    (the data, the optimizer, a callback, a tracker)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    builder: str
    """Import path 'package.module:function' (a class works too, e.g. 'torch.optim:AdamW')."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the builder."""

    @field_validator("builder")
    @classmethod
    def _import_path(cls, path: str) -> str:
        return checked_import_path(path)


def checked_import_path(path: str) -> str:
    """``path`` when it looks like 'package.module:attr'.

    Raises:
        ValueError: If it does not (a validator's message).
    """
    module, sep, attr = path.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"{path!r}: an import path must look like 'package.module:function'")
    return path


def _import_path_checked(spec: str | BuilderSpec) -> str | BuilderSpec:
    return checked_import_path(spec) if isinstance(spec, str) else spec


Named = Annotated[str | BuilderSpec, AfterValidator(_import_path_checked)]
"""A run config's entry that names an object: 'package.module:Class', or a ``BuilderSpec``."""


def build_named(spec: str | BuilderSpec | Any, where: str, kind: type) -> Any:
    """What ``spec`` names, built: an import path ('module:Class', called without
    arguments), a ``BuilderSpec`` or mapping of one (called with its ``args``); anything
    else is taken as it is (an object given in code).

    Raises:
        UsageError: If the path names nothing (see ``import_builder``), or what it gives is
            no ``kind`` (shoal's base class, e.g. ``shoal.Callback``).
    """
    if isinstance(spec, str):
        spec = BuilderSpec(builder=spec)
    elif isinstance(spec, dict):
        spec = BuilderSpec(**spec)
    made = import_builder(spec.builder, where)(**spec.args) \
        if isinstance(spec, BuilderSpec) else spec
    if not isinstance(made, kind):
        raise UsageError(f"{where}: {type(made).__name__} is not a shoal.{kind.__name__} "
                         "(subclass it, and override what you need)")
    return made


def import_builder(path: str, where: str) -> Any:
    """The object behind 'package.module:attr', or a UsageError naming the config key, the
    places searched and, for a likely typo, the closest existing name."""
    module_name, _, attr = path.partition(":")
    try:
        module = import_module(module_name, path)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    target: Any = module
    for depth, name in enumerate(attr.split(".")):
        if not hasattr(target, name):
            owner = ".".join([module_name, *attr.split(".")[:depth]])
            hint = _did_you_mean(name, [n for n in dir(target) if not n.startswith("__")])
            raise UsageError(f"{where}: {owner!r} has no attribute {name!r}{hint}")
        target = getattr(target, name)
    if not callable(target):
        raise UsageError(f"{where}: {path!r} is not callable")
    extra = getattr(target, "shoal_extra", None)  # shoal.extras.needs
    if extra is not None:
        require(extra, f"{where}: {path}")
    return target


def import_module(module_name: str, path: str) -> ModuleType:
    """Import ``module_name`` (named in the config as ``path``), or a one-line UsageError:
    where it looked and the closest name, or which of its own imports failed."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not (module_name == missing or module_name.startswith(missing + ".")):
            # The module imports something that is not installed: one of shoal's extras?
            extra = extra_of(missing)
            install = f": {install_line(extra)}" if extra else " (ModuleNotFoundError)"
            raise UsageError(f"cannot import {path!r}: it imports {missing!r}, which is not "
                             f"installed{install}") from None
        raise UsageError(f"cannot import {path!r}: no module named {missing!r}"
                         f"{_module_hint(missing)}; looked in {_searched()}; add a directory "
                         f"with PYTHONPATH=DIR") from None
    except Exception as exc:  # a module may fail to import with any error, SyntaxError too
        raise UsageError(f"cannot import {path!r} "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())})") from None


def _module_hint(missing: str) -> str:
    """', did you mean ...' for a module name one typo away from one that exists."""
    parent, _, leaf = missing.rpartition(".")
    if parent:
        try:
            search = importlib.import_module(parent).__path__
        except (ImportError, AttributeError):
            return ""
    else:
        search = None  # every top-level module on sys.path
    names = [info.name for info in pkgutil.iter_modules(search)]
    return _did_you_mean(leaf, names, prefix=f"{parent}." if parent else "")


def _did_you_mean(name: str, candidates: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def _searched() -> str:
    """sys.path in a line: directories by name, the installed packages as one item."""
    shown, site = [], False
    for entry in sys.path:
        if "site-packages" in entry or "dist-packages" in entry or entry.endswith(".zip"):
            site = True
            continue
        stdlib = (Path(entry) / "os.py").is_file() or entry.endswith("lib-dynload")
        if entry and Path(entry).is_dir() and not stdlib:
            shown.append(entry)
    shown = list(dict.fromkeys(shown))
    return ", ".join(shown + (["the installed packages"] if site else []))
