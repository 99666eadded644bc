"""Distributed reinforcement learning: environment-parallel PPO on shoal's launcher.

The names below are imported on first use: a run's configuration reads ``PPOConfig``
without importing the trainer behind ``PPO``.
"""

from __future__ import annotations

from shoal.lazy import lazy_names

TYPE_CHECKING = False  # as in shoal/__init__.py, without importing typing

_LAZY = {"PPO": "shoal.rl.ppo", "PPOConfig": "shoal.rl.config"}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # what type checkers and editors see
    from shoal.rl.config import PPOConfig as PPOConfig
    from shoal.rl.ppo import PPO as PPO


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
