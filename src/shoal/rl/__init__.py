"""Distributed reinforcement learning: environment-parallel PPO on shoal's launcher."""

from shoal.rl.config import PPOConfig
from shoal.rl.ppo import PPO

__all__ = ["PPO", "PPOConfig"]
