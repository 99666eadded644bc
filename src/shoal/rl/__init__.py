"""Distributed reinforcement learning: environment-parallel PPO on shoal's launcher.

The names below are imported on first use: a run's configuration reads ``PPOConfig``
without importing the trainer behind ``PPO``.
"""

from __future__ import annotations

from shoal.lazy import lazy_names

_LAZY = {"PPO": "shoal.rl.ppo", "PPOConfig": "shoal.rl.config"}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
