"""Each rank's vector of gymnasium environments: checked, seeded, and checkpointed exactly.

An environment's state is what its ``reset``/``step`` change: plain attributes (numbers,
numpy arrays) of the environment and of each wrapper around it, and its random generator.
They are captured as tensors and JSON values, never pickled, so loading a checkpoint runs
no stored code; an environment whose state lives elsewhere (a physics engine's handle)
cannot be captured, and is refused when a checkpoint is written.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, NamedTuple

import numpy as np
import torch

from shoal.extras import require
from shoal.imports import import_module

_PLAIN = (bool, int, float, str, type(None))
# Attributes that describe an environment rather than hold its state.
_SKIP = {"spec", "metadata", "render_mode", "_saved_kwargs", "_cached_spec"}


class EnvInfo(NamedTuple):
    """What the policy needs to know of an environment."""

    obs_dim: int
    discrete: bool
    action_dim: int  # actions (discrete) or action components (continuous)
    low: np.ndarray | None  # continuous bounds, for clipping what is sent to the env
    high: np.ndarray | None


def _import_registering_module(env_id: str) -> str:
    """'package.module:Id': import the module that registers Id (as gymnasium does)."""
    module, sep, name = env_id.rpartition(":")
    if sep:
        import_module(module, env_id)  # a UsageError: where it looked, the closest name
    return name if sep else env_id


@functools.cache  # the config's check and the learner's ask once per process, not twice
def check_env(env_id: str) -> EnvInfo:
    """The environment's spaces; a ValueError naming the closest ids when ``env_id`` is not
    registered, or the space when the learner cannot handle it."""
    require("rl", "reinforcement learning (an rl: run)")
    import gymnasium as gym

    name = _import_registering_module(env_id)
    if name not in gym.registry:
        close = difflib.get_close_matches(name, list(gym.registry), n=3, cutoff=0.5)
        hint = (f"the closest registered ids: {', '.join(close)}" if close
                else "see gymnasium.pprint_registry() for the registered ids")
        raise ValueError(f"unknown environment {name!r}; {hint}")
    env = gym.make(name, disable_env_checker=True)
    try:
        obs, act = env.observation_space, env.action_space
    finally:
        env.close()
    if not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise ValueError(f"{name}'s observation space is {obs}; the PPO learner takes flat "
                         "Box observations (a vector of numbers)")
    if isinstance(act, gym.spaces.Discrete):
        return EnvInfo(int(obs.shape[0]), True, int(act.n), None, None)
    if isinstance(act, gym.spaces.Box) and len(act.shape) == 1:
        return EnvInfo(int(obs.shape[0]), False, int(act.shape[0]), act.low, act.high)
    raise ValueError(f"{name}'s action space is {act}; the PPO learner handles Discrete "
                     "and one-dimensional Box action spaces")


def derive_seed(*words: int) -> int:
    """A 32-bit seed from several integers (seed, rank, environment, ...), well mixed."""
    return int(np.random.SeedSequence([w & 0xFFFFFFFF for w in words]).generate_state(1)[0])


def make_envs(env_id: str, num_envs: int, seeds: list[int]) -> tuple[Any, np.ndarray]:
    """A synchronous vector of ``num_envs`` environments, reset with ``seeds``; returns it
    and the first observations. A finished episode resets within the same step (its last
    observation is in the info), as PPO's bootstrapping expects."""
    import gymnasium as gym

    name = _import_registering_module(env_id)
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(name, disable_env_checker=True) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    # ignore: gymnasium's stub wants a list[int | None] (invariant list); a list[int] is fine
    obs, _ = envs.reset(seed=seeds)  # type: ignore[arg-type]
    return envs, obs


def _layers(env: Any) -> list[Any]:
    layers = [env]
    while hasattr(layers[-1], "env"):
        layers.append(layers[-1].env)
    return layers


def capture_envs(envs: Any) -> list[list[dict]]:
    """Every environment's state, layer by layer (wrappers first), as tensors and JSON."""
    states = []
    for env in envs.envs:
        layers = []
        for layer in _layers(env):
            state: dict[str, Any] = {}
            for key, value in vars(layer).items():
                if key in _SKIP:
                    continue
                if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
                    state[key] = torch.from_numpy(value.copy())
                elif isinstance(value, np.generic):
                    state[key] = value.item()
                elif isinstance(value, _PLAIN):
                    state[key] = value
                elif isinstance(value, np.random.Generator):
                    state[key] = {"generator": value.bit_generator.state}
            layers.append(state)
        states.append(layers)
    return states


def restore_envs(envs: Any, states: list[list[dict]]) -> None:
    """Put back what ``capture_envs`` took, into environments of the same kind."""
    for env, layers in zip(envs.envs, states, strict=True):
        for layer, state in zip(_layers(env), layers, strict=True):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    setattr(layer, key, value.numpy().copy())
                elif isinstance(value, dict) and "generator" in value:
                    generator = getattr(layer, key)
                    generator.bit_generator.state = value["generator"]
                else:
                    setattr(layer, key, value)
