"""The actor-critic: two small MLPs, a categorical or a diagonal Gaussian policy."""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from shoal.rl.envs import EnvInfo


def _mlp(inputs: int, hidden: int, outputs: int, last_gain: float) -> nn.Sequential:
    layers = [nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
              nn.Linear(hidden, outputs)]
    for layer, gain in zip(cast("list[nn.Linear]", layers[::2]),
                           (math.sqrt(2), math.sqrt(2), last_gain), strict=True):
        nn.init.orthogonal_(layer.weight, gain)
        nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """``forward(obs, actions)`` gives what the PPO loss needs (log-probabilities, entropy,
    values) and is what DDP wraps; ``act`` samples while collecting, without gradients."""

    def __init__(self, info: EnvInfo, hidden: int = 64):
        super().__init__()
        self.discrete = info.discrete
        self.critic = _mlp(info.obs_dim, hidden, 1, 1.0)
        self.actor = _mlp(info.obs_dim, hidden, info.action_dim, 0.01)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(info.action_dim))

    def _dist(self, obs: torch.Tensor) -> Categorical | Normal:
        out = self.actor(obs)
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        return Normal(out, self.log_std.exp().expand_as(out), validate_args=False)

    def _log_prob(self, dist: Categorical | Normal, actions: torch.Tensor) -> torch.Tensor:
        logp = dist.log_prob(actions)
        return logp if self.discrete else logp.sum(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = self._dist(obs)
        entropy = dist.entropy() if self.discrete else dist.entropy().sum(-1)
        return self._log_prob(dist, actions), entropy, self.value(obs)

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled actions, their log-probabilities and the values of ``obs``."""
        if self.discrete:  # what Categorical does, without building one every step
            logp = self.actor(obs).log_softmax(-1)
            actions = torch.multinomial(logp.exp(), 1)
            return actions.squeeze(-1), logp.gather(-1, actions).squeeze(-1), self.value(obs)
        dist = self._dist(obs)
        actions = dist.sample()
        return actions, self._log_prob(dist, actions), self.value(obs)

    @torch.no_grad()
    def best(self, obs: torch.Tensor) -> torch.Tensor:
        """The deterministic action: the most likely one, or the Gaussian's mean."""
        out = self.actor(obs)
        return out.argmax(-1) if self.discrete else out


def to_env(actions: torch.Tensor, info: EnvInfo) -> np.ndarray:
    """Actions as the environments take them: continuous ones clipped to the bounds."""
    array = actions.cpu().numpy()
    return array if info.discrete else np.clip(array, info.low, info.high)
