"""Collecting a rollout on one rank, and its advantages (GAE)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shoal.rl.envs import EnvInfo
from shoal.rl.policy import ActorCritic, to_env

Batch = dict[str, torch.Tensor]  # obs, actions, logprobs, advantages, returns, values


class Episodes:
    """Running return and length of each environment's episode, and the finished ones."""

    def __init__(self, num_envs: int):
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []  # since the last take()
        self.count = 0  # episodes finished on this rank, in the whole run

    def step(self, rewards: np.ndarray, dones: np.ndarray) -> None:
        self.returns += rewards
        self.lengths += 1
        for i in np.flatnonzero(dones):
            self.finished.append((float(self.returns[i]), int(self.lengths[i])))
            self.returns[i], self.lengths[i] = 0.0, 0
        self.count += int(dones.sum())

    def take(self) -> tuple[int, float, float]:
        """(episodes, sum of their returns, sum of their lengths) since the last call."""
        done, self.finished = self.finished, []
        return len(done), sum(r for r, _ in done), float(sum(n for _, n in done))

    def state_dict(self) -> dict[str, Any]:
        return {"returns": torch.from_numpy(self.returns.copy()),
                "lengths": torch.from_numpy(self.lengths.copy()), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.returns = state["returns"].numpy().copy()
        self.lengths = state["lengths"].numpy().copy()
        self.count = state["count"]


@torch.no_grad()
def collect(policy: ActorCritic, envs: Any, info: EnvInfo, obs: np.ndarray, steps: int,
            gamma: float, gae_lambda: float, episodes: Episodes,
            device: torch.device) -> tuple[Batch, np.ndarray]:
    """Step every environment ``steps`` times from ``obs``; returns the flat batch (with
    advantages and returns) and the observations to continue from.

    An episode cut by a time limit is not a failure: its last reward is bootstrapped with
    the value of the observation it was cut at.
    """
    n = envs.num_envs
    t_obs = torch.empty(steps, n, info.obs_dim, device=device)
    t_actions: list[torch.Tensor] = []
    t_logp = torch.empty(steps, n, device=device)
    t_values = torch.empty(steps, n, device=device)
    rewards = np.empty((steps, n), dtype=np.float32)
    dones = np.empty((steps, n), dtype=np.float32)
    for t in range(steps):
        t_obs[t] = torch.as_tensor(obs, dtype=torch.float32, device=device)
        actions, logp, values = policy.act(t_obs[t])
        t_actions.append(actions)
        t_logp[t], t_values[t] = logp, values
        obs, reward, terminated, truncated, extra = envs.step(to_env(actions, info))
        done = terminated | truncated
        episodes.step(reward, done)
        reward = reward.astype(np.float32)
        cut = truncated & ~terminated
        if cut.any():
            final = torch.as_tensor(np.stack(extra["final_obs"][cut]), dtype=torch.float32,
                                    device=device)
            reward[cut] += gamma * policy.value(final).cpu().numpy()
        rewards[t], dones[t] = reward, done
    last_value = policy.value(torch.as_tensor(obs, dtype=torch.float32, device=device))
    t_rewards = torch.from_numpy(rewards).to(device)
    t_dones = torch.from_numpy(dones).to(device)
    advantages = torch.empty_like(t_values)
    running = torch.zeros(n, device=device)
    for t in reversed(range(steps)):
        next_value = last_value if t == steps - 1 else t_values[t + 1]
        alive = 1.0 - t_dones[t]
        delta = t_rewards[t] + gamma * next_value * alive - t_values[t]
        running = delta + gamma * gae_lambda * alive * running
        advantages[t] = running
    batch = {"obs": t_obs.reshape(steps * n, -1),
             "actions": torch.stack(t_actions).reshape(steps * n, *t_actions[0].shape[1:]),
             "logprobs": t_logp.reshape(-1), "advantages": advantages.reshape(-1),
             "returns": (advantages + t_values).reshape(-1), "values": t_values.reshape(-1)}
    return batch, obs
