"""The schema of a `shoal train` run config (YAML), validated before any process starts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shoal.imports import BuilderSpec, checked_import_path
from shoal.models.hf import HFModelConfig
from shoal.remote.tier import RemoteConfig, splits_parameters
from shoal.rl.config import PPOConfig
from shoal.training.config import TrainerConfig

BuilderConfig = BuilderSpec


class ModelConfig(BaseModel):
    """The model: built by a function named by import path, or a transformers model class
    built from its config."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    builder: str | None = None
    """Import path 'package.module:function' of a function (or class) returning the
    nn.Module."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the builder."""
    hf: HFModelConfig | None = None
    """Instead of a builder: a transformers model class and its config arguments, e.g.
    {class: GPT2LMHeadModel, config: {n_layer: 2, n_embd: 64, n_head: 2}} (needs
    shoal[hf])."""

    @field_validator("builder")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        return checked_import_path(value) if value is not None else None

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.builder is None) == (self.hf is None):
            raise ValueError("give either builder (with args) or hf, not both or neither")
        if self.hf is not None and self.args:
            raise ValueError("args go with builder; a transformers model takes hf.config")
        return self


class RunSection(BaseModel):
    """Where the run writes and how many processes it uses."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dir: str | None = None
    """Run directory (resolved config, final metrics); default runs/<config name>."""
    nproc_per_node: int = Field(1, gt=0)
    """Worker processes on this node (the --nproc-per-node flag overrides it)."""
    code_paths: list[str] | None = None
    """Directories searched first for the modules that builders name, before the environment
    (PYTHONPATH, installed packages); relative ones are taken from the config file's
    directory. Default: the config file's directory, then the current directory. The resolved
    config holds them as absolute paths, so every rank and node searches the same places."""


class RunConfig(BaseModel):
    """A whole training run: what to build and how to train it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: ModelConfig
    """Builds the nn.Module: a builder, or a transformers class (``hf``)."""
    data: BuilderConfig
    """Returns (train, val) datasets or loaders, or just train."""
    optimizer: BuilderConfig
    """Called as builder(model.parameters(), **args)."""
    lr_scheduler: BuilderConfig | None = None
    """Called as builder(optimizer, **args); stepped after each optimizer step."""
    loss: BuilderConfig | None = None
    """Returns loss_fn(outputs, targets): targets of (inputs, targets) batches, the whole
    batch otherwise. Default: cross-entropy for pairs, the model's own loss otherwise."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Trainer settings (see shoal.TrainerConfig)."""
    run: RunSection = Field(default_factory=RunSection)
    """Run directory and process count."""
    remote_hardware: RemoteConfig | None = None
    """A remote tier for the model's RemoteModule (see docs/remote.md)."""

    @model_validator(mode="after")
    def _remote_strategy(self) -> RunConfig:
        t = self.trainer
        why = splits_parameters(t.strategy, t.parallel.tp, t.parallel.pp)
        if self.remote_hardware is not None and why:
            raise ValueError(f"remote_hardware: {why}")
        return self


class RLRunConfig(BaseModel):
    """A reinforcement learning run: an ``rl:`` section instead of model, data, trainer."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rl: PPOConfig
    """The PPO learner and its environments (see shoal.rl.PPOConfig)."""
    run: RunSection = Field(default_factory=RunSection)
    """Run directory and process count."""
