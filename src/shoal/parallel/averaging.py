"""Periodic weight averaging: ranks train their own copies and meet every ``period`` steps.

    local_sgd  each rank steps its own optimizer; every H steps the weights are averaged.
    diloco     the user's optimizer is the inner one; every H steps the averaged change of
               the weights since the last meeting is the gradient of an outer SGD with
               Nesterov momentum on the shared weights (DiLoCo). Its all-reduce may be bf16.

No gradient is communicated between meetings, so the model is not wrapped in DDP; the
replicas start from rank 0's weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from shoal.parallel.comm import Comm
from shoal.parallel.traffic import Traffic, all_reduce_bytes


class LocalSGDConfig(BaseModel):
    """Settings of the 'local_sgd' strategy."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    period: int = Field(8, ge=1)
    """H: optimizer steps between two averagings of the weights."""


class DiLoCoConfig(BaseModel):
    """Settings of the 'diloco' strategy."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    period: int = Field(32, ge=1)
    """H: inner optimizer steps between two outer steps."""
    outer_lr: float = Field(0.7, gt=0)
    """Learning rate of the outer SGD."""
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    """Nesterov momentum of the outer SGD."""
    outer_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the outer all-reduce: 'bf16' sends half the bytes."""


def broadcast_module(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Give every rank rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0, group=group)


def _flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _unflatten_into(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


class _Periodic(Comm):
    """Counts optimizer steps and meets every ``period``."""

    def __init__(self, model: nn.Module, period: int, traffic: Traffic,
                 group: dist.ProcessGroup | None = None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.period = period
        self.traffic = traffic
        self.group = group
        self.world = dist.get_world_size(group)
        self.local_step = 0  # steps since the last meeting
        self.across: Callable[[torch.Tensor], torch.Tensor] | None = None
        """In a live job: the mean over the replica groups (after the mean inside this
        group). The meeting is then due at the start of the next step (``due``), where the
        live session holds it, rather than at the end of the period's last step."""

    def after_step(self) -> None:
        self.local_step += 1
        if self.local_step >= self.period and self.across is None:
            self.synchronize()

    @property
    def due(self) -> bool:
        return self.local_step >= self.period

    def synchronize(self) -> None:
        """Meet now, unless the replicas just met (the end of training calls this, so every
        rank ends with the same model)."""
        if self.local_step == 0:
            return
        start = time.perf_counter()
        with torch.no_grad():
            mean = self._all_reduce_mean(self.contribution())
            if self.across is not None:
                mean = self.across(mean)
            self.apply(mean)
        self.local_step = 0
        self.traffic.blocking(time.perf_counter() - start)

    def _all_reduce_mean(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return flat
        self.traffic.sent(all_reduce_bytes(flat.numel() * flat.element_size(), self.world))
        flat /= self.world
        dist.all_reduce(flat, group=self.group)
        return flat

    def contribution(self) -> torch.Tensor:
        """What this rank brings to the meeting (a new flat tensor)."""
        raise NotImplementedError

    def apply(self, mean: torch.Tensor) -> None:
        """Take the meeting's mean of the contributions."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"local_step": self.local_step}

    def load_state_dict(self, state: dict) -> None:
        self.local_step = state["local_step"]


class LocalSGD(_Periodic):
    """Average the weights every ``period`` steps."""

    def contribution(self) -> torch.Tensor:
        return _flat(self.params)

    def apply(self, mean: torch.Tensor) -> None:
        _unflatten_into(mean, self.params)


class DiLoCo(_Periodic):
    """Outer Nesterov SGD on the averaged weight change, every ``period`` inner steps."""

    def __init__(self, model: nn.Module, config: DiLoCoConfig, traffic: Traffic,
                 group: dist.ProcessGroup | None = None):
        super().__init__(model, config.period, traffic, group)
        self.dtype = torch.bfloat16 if config.outer_dtype == "bf16" else None
        # The shared weights of the last meeting, which the outer optimizer updates.
        self.outer_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.outer_params, lr=config.outer_lr,
                                     momentum=config.outer_momentum,
                                     nesterov=config.outer_momentum > 0)

    def contribution(self) -> torch.Tensor:
        change = _flat(self.outer_params) - _flat(self.params)  # the outer "gradient"
        return change.to(self.dtype) if self.dtype is not None else change

    def apply(self, mean: torch.Tensor) -> None:
        change = mean.to(self.outer_params[0].dtype)
        offset = 0
        for outer in self.outer_params:
            outer.grad = change[offset:offset + outer.numel()].view_as(outer).clone()
            offset += outer.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for p, outer in zip(self.params, self.outer_params, strict=True):
            p.data.copy_(outer)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "outer_params": [p.clone() for p in self.outer_params],
                "outer_optimizer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for p, saved in zip(self.outer_params, state["outer_params"], strict=True):
                p.copy_(saved)
        self.outer.load_state_dict(state["outer_optimizer"])


def apply_local_sgd(model: nn.Module, config: LocalSGDConfig, traffic: Traffic) -> LocalSGD:
    """Start every replica from rank 0's weights; returns the averager to call after each
    optimizer step."""
    broadcast_module(model)
    return LocalSGD(model, config.period, traffic)


def apply_diloco(model: nn.Module, config: DiLoCoConfig, traffic: Traffic) -> DiLoCo:
    """Like ``apply_local_sgd``, with DiLoCo's outer optimizer."""
    broadcast_module(model)
    return DiLoCo(model, config, traffic)
