"""Import what a run config names as 'package.module:attr' (builders, plugins).

Kept apart from the loader so that a feature (the remote tier, RL environments) can import
user code without importing the config layer that collects the features' settings.
"""

from __future__ import annotations

import importlib
from typing import Any

from shoal.errors import UsageError


def import_builder(path: str, where: str) -> Any:
    """The object behind 'package.module:attr', or a UsageError naming the config key."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a module may fail to import with any error, SyntaxError too
        raise UsageError(f"{where}: cannot import {path!r} "
                         f"({type(exc).__name__}: {exc})") from None
    target: Any = module
    for name in attr.split("."):
        if not hasattr(target, name):
            raise UsageError(f"{where}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, name)
    if not callable(target):
        raise UsageError(f"{where}: {path!r} is not callable")
    return target
