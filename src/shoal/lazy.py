"""A package's names imported on first use (PEP 562's module ``__getattr__``), so that
importing the package costs nothing of what its names need until one is used. Imports
nothing but importlib: a worker of `shoal run` imports ``shoal`` before the user's script."""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def lazy_names(package: str, names: dict[str, str], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose ``names`` (name: the module
    that defines it) are imported when first asked for and then kept in ``namespace`` (the
    package's globals), so later lookups do not come back here."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})  # a name used once is in both

    return __getattr__, __dir__
