"""Deterministic evaluation: the policy's most likely actions on fixed episodes."""

from __future__ import annotations

import numpy as np
import torch

from shoal.rl.envs import EnvInfo, derive_seed, make_envs
from shoal.rl.policy import ActorCritic, to_env

_EVAL_STREAM = 0x5EED  # keeps evaluation seeds apart from every rank's training seeds


@torch.no_grad()
def evaluate(policy: ActorCritic, env_id: str, info: EnvInfo, episodes: int, seed: int,
             device: torch.device) -> tuple[float, float]:
    """Mean and standard deviation of the return over ``episodes`` episodes, one per
    environment, run side by side. The same seeds every call, and no training state is
    touched (no random number is drawn), so evaluating never changes a run."""
    envs, obs = make_envs(env_id, episodes,
                          [derive_seed(seed, _EVAL_STREAM, i) for i in range(episodes)])
    returns = np.zeros(episodes)
    running = np.ones(episodes, dtype=bool)
    try:
        while running.any():
            actions = policy.best(torch.as_tensor(obs, dtype=torch.float32, device=device))
            obs, reward, terminated, truncated, _ = envs.step(to_env(actions, info))
            returns += reward * running
            running &= ~(terminated | truncated)
    finally:
        envs.close()
    return float(returns.mean()), float(returns.std())
