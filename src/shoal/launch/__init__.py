"""Launching workers on torch.distributed.elastic: `shoal run` and `shoal.spawn`.

The names are looked up when first used: a worker started as a command
(``python -m shoal.launch.worker``) imports this package first, and must not pay for the
launcher's imports (torch among them) before the user's script runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.launch.config import LaunchSpec
    from shoal.launch.launcher import launch

__all__ = ["LaunchSpec", "launch"]


def __getattr__(name: str) -> Any:
    if name == "LaunchSpec":
        from shoal.launch.config import LaunchSpec

        return LaunchSpec
    if name == "launch":
        from shoal.launch.launcher import launch

        return launch
    raise AttributeError(f"module 'shoal.launch' has no attribute {name!r}")
