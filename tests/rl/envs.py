"""Environments for the RL tests, registered on import (``tests.rl.envs:Id``)."""

import os
import signal

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control import CartPoleEnv


class KillingCartPole(CartPoleEnv):
    """CartPole that SIGKILLs its own process at its Nth step, on one rank of the job's
    first attempt, when SHOAL_TEST_KILL="rank:N" is set (the runs to compare leave it
    unset, and step the same environment)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps_taken = 0

    def step(self, action):
        self.steps_taken += 1
        plan = os.environ.get("SHOAL_TEST_KILL")
        if plan and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            rank, at = (int(x) for x in plan.split(":"))
            if int(os.environ.get("RANK", "0")) == rank and self.steps_taken == at:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


class SwitchBoard(gym.Env):
    """An action space the PPO learner does not handle (MultiBinary)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.MultiBinary(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, True, False, {}


gym.register("KillCartPole-v1", entry_point=KillingCartPole, max_episode_steps=500)
gym.register("SwitchBoard-v0", entry_point=SwitchBoard, max_episode_steps=10)
