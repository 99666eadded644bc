"""PPOConfig: every setting of the PPO learner (the ``rl:`` section of a run config),
validated once, before any worker starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shoal.checkpoint import layout
from shoal.errors import UsageError
from shoal.metrics.recorder import MetricsConfig
from shoal.rl.envs import check_env


class PPOConfig(BaseModel):
    """Proximal policy optimization on vectorized gymnasium environments, one set per rank.

    The global batch of an update is num_envs x num_steps x world size environment steps;
    each rank learns from its own share and the gradients are all-reduced once per
    minibatch, so every rank holds the same policy after every optimizer step."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env: str = "CartPole-v1"
    """A registered gymnasium environment id ('CartPole-v1', 'Acrobot-v1', 'Pendulum-v1'),
    or 'package.module:Id' to import the module that registers it first."""
    num_envs: int = Field(8, gt=0)
    """Environments each rank steps (one vector of them)."""
    num_steps: int = Field(32, gt=0)
    """Steps of each environment per update (the rollout length)."""
    total_steps: int = Field(100_000, gt=0)
    """Environment steps of the whole job (all ranks together) to train for."""
    learning_rate: float = Field(1e-3, gt=0)
    """Adam's learning rate (annealed linearly to 0 with ``anneal_lr``)."""
    anneal_lr: bool = True
    """Decrease the learning rate linearly to 0 over the run."""
    gamma: float = Field(0.98, ge=0, le=1)
    """Discount factor."""
    gae_lambda: float = Field(0.8, ge=0, le=1)
    """Generalized advantage estimation's lambda."""
    update_epochs: int = Field(20, gt=0)
    """Passes over the rollout per update."""
    num_minibatches: int = Field(1, gt=0)
    """Minibatches per pass; one gradient all-reduce and optimizer step each."""
    accumulate: int = Field(1, gt=0)
    """Micro-batches per minibatch (gradient accumulation): less memory, same update."""
    clip_coef: float = Field(0.2, gt=0)
    """PPO's clipping of the probability ratio."""
    ent_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus."""
    vf_coef: float = Field(0.5, ge=0)
    """Weight of the value loss."""
    max_grad_norm: float | None = Field(0.5, gt=0)
    """Clip the global gradient norm to this value before each optimizer step."""
    norm_adv: bool = True
    """Normalize advantages over the global batch (all ranks' samples) of each update."""
    hidden: int = Field(64, gt=0)
    """Width of the two hidden layers of the actor and of the critic."""
    seed: int = 0
    """Seeds the policy's initial weights (rank 0's, broadcast), each rank's sampling and
    each environment (derived from seed, rank and environment index)."""
    backend: Literal["gloo", "nccl"] | None = None
    """Process group backend; default nccl on GPUs, gloo on CPUs."""
    eval_every: int | None = Field(None, gt=0)
    """Evaluate the deterministic policy every this many updates (and at the end)."""
    eval_episodes: int = Field(20, gt=0)
    """Episodes of each evaluation (rank 0, environments seeded apart from training)."""
    target_return: float | None = None
    """Stop once an evaluation's mean return reaches this."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (at update boundaries); unset: none are written."""
    checkpoint_every: int | None = Field(None, gt=0)
    """Save every this many updates (and at the end, and when preempted)."""
    keep_last: int = Field(3, gt=0)
    """Checkpoints kept."""
    resume: str | None = None
    """'auto' (the newest checkpoint in checkpoint_dir, if any) or a checkpoint path."""
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig(every=10))
    """Step metrics; one 'step' is one update."""
    log_every: int = Field(10, gt=0)
    """Print progress on rank 0 every this many updates."""
    progress: bool = True
    """Print progress and the end-of-run table."""

    @field_validator("env")
    @classmethod
    def _known_env(cls, value: str) -> str:
        check_env(value)  # a UsageError: one line, the closest ids
        return value

    @model_validator(mode="after")
    def _divides(self) -> PPOConfig:
        rollout = self.num_envs * self.num_steps
        parts = self.num_minibatches * self.accumulate
        if rollout % parts:
            raise ValueError(
                f"num_envs x num_steps = {rollout} samples per rank cannot be split into "
                f"num_minibatches {self.num_minibatches} x accumulate {self.accumulate} = "
                f"{parts} equal parts: choose values whose product divides {rollout}")
        if (self.checkpoint_every or self.resume == "auto") and not self.checkpoint_dir:
            raise ValueError("checkpoint_every and resume='auto' need checkpoint_dir")
        if self.resume not in (None, "auto"):
            problem = layout.problem(Path(self.resume))
            if problem is not None:
                raise ValueError(f"resume {self.resume}: {problem}")
        return self

    def updates(self, world_size: int) -> int:
        """Updates the run makes at this world size; a UsageError when not even one fits."""
        batch = self.num_envs * self.num_steps * world_size
        if self.total_steps < batch:
            raise UsageError(f"rl.total_steps {self.total_steps} is less than one update's "
                             f"global batch of {batch} environment steps (num_envs "
                             f"{self.num_envs} x num_steps {self.num_steps} x {world_size} "
                             "processes)")
        return self.total_steps // batch
