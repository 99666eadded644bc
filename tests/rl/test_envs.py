"""Environment state is captured without pickling and restored exactly, for each shipped
environment: a restored vector continues the very episodes the captured one would have."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.checkpoint import tree
from shoal.rl.envs import capture_envs, check_env, make_envs, restore_envs


def _run(envs, actions):
    out = []
    for a in actions:
        obs, reward, terminated, truncated, _ = envs.step(a)
        out.append((obs.copy(), reward.copy(), terminated.copy(), truncated.copy()))
    return out


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Acrobot-v1", "Pendulum-v1"])
def test_restored_environments_continue_bit_for_bit(env_id):
    info = check_env(env_id)
    rng = np.random.default_rng(0)

    def actions(n):
        if info.discrete:
            return [rng.integers(0, info.action_dim, 4) for _ in range(n)]
        return [rng.uniform(info.low, info.high, (4, info.action_dim)).astype(np.float32)
                for _ in range(n)]

    envs, _ = make_envs(env_id, 4, [1, 2, 3, 4])
    _run(envs, actions(60))  # mid-episode, some episodes already reset
    state = capture_envs(envs)
    skeleton, tensors = tree.split(state, "envs")  # what a checkpoint stores: no pickle
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    later = actions(300)
    expected = _run(envs, later)
    fresh, _ = make_envs(env_id, 4, [9, 9, 9, 9])
    restore_envs(fresh, tree.join(skeleton, tensors))
    got = _run(fresh, later)
    for (a, b) in zip(expected, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)
