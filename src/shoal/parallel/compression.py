"""Gradient compression for DDP, as communication hooks, with every byte counted.

    none      all-reduce of the gradient as it is (DDP's own, no hook)
    fp16/bf16 all-reduce in half precision: half the bytes (torch's compress hooks)
    powersgd  low-rank PowerSGD with error feedback and warm start (torch's hook)
    topk      the ratio of largest entries, with error feedback (shoal.parallel.topk)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from shoal.parallel.comm import Comm
from shoal.parallel.powersgd import PowerSGDHook
from shoal.parallel.topk import TopKHook
from shoal.parallel.traffic import Traffic, all_reduce_bytes

CompressionName = Literal["none", "fp16", "bf16", "powersgd", "topk"]


class CompressionConfig(BaseModel):
    """How DDP sends gradients. Also accepted as a bare name: ``compression: topk``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: CompressionName = "none"
    """'none', 'fp16', 'bf16', 'powersgd' or 'topk'."""
    rank: int = Field(1, ge=1)
    """powersgd: rank of the low-rank approximation (higher: more bytes, more accurate)."""
    warmup_steps: int = Field(10, ge=2)
    """powersgd: steps of plain all-reduce before compressing (at least 2: DDP settles its
    buckets in the first step)."""
    ratio: float = Field(0.01, gt=0, le=1)
    """topk: fraction of gradient entries each rank sends per step, in (0, 1]."""

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class _Uncompressed(Comm):
    """No hook: DDP's own all-reduce in C++, the fastest. Counted from outside instead: the
    bytes are every gradient's; on the CPU the wait is from the last gradient computed (a
    post-accumulate hook on each parameter) to the end of backward, which DDP spends waiting
    for its last buckets. On a GPU backward only queues kernels and the all-reduce runs on
    its own stream, so the CPU's clock cannot see that wait: no hooks there (a Python call
    per parameter per step, for nothing), and the wait counts as 0."""

    def __init__(self, model: DistributedDataParallel, traffic: Traffic):
        self.model = model
        self.traffic = traffic
        params = [p for p in model.module.parameters() if p.requires_grad]
        self.nbytes = all_reduce_bytes(sum(p.numel() * p.element_size() for p in params),
                                       dist.get_world_size(model.process_group))
        if not model.device_ids:  # CPU
            for p in params:
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, _: torch.Tensor) -> None:
        self.traffic.launched()

    def after_backward(self) -> None:
        if self.model.require_backward_grad_sync:  # False inside no_sync (accumulation)
            self.traffic.sent(self.nbytes)
            self.traffic.done()


class _Counted(Comm):
    """torch's half-precision hooks (fp16, bf16), with their bytes and wait counted."""

    def __init__(self, name: str, traffic: Traffic, group: dist.ProcessGroup | None):
        self.inner = {"fp16": default_hooks.fp16_compress_hook,
                      "bf16": default_hooks.bf16_compress_hook}[name]
        self.traffic = traffic
        self.group = group
        self.world = dist.get_world_size(group)

    @staticmethod
    def hook(self, bucket):  # no annotations: DDP checks them literally
        buffer = bucket.buffer()
        self.traffic.sent(all_reduce_bytes(buffer.numel() * 2, self.world))
        self.traffic.launched()

        def done(f: torch.futures.Future) -> torch.Tensor:
            self.traffic.done()
            return f.value()
        return self.inner(self.group, bucket).then(done)


Compressor = _Uncompressed | _Counted | PowerSGDHook | TopKHook


def apply_compression(model: DistributedDataParallel, config: CompressionConfig,
                      traffic: Traffic, seed: int = 0) -> Compressor:
    """Register the communication hook ``config`` names on ``model``; returns its state,
    which checkpoints save and restore (``state_dict``/``load_state_dict``)."""
    group = model.process_group
    if config.name == "none":
        return _Uncompressed(model, traffic)
    if config.name == "powersgd":
        state: _Counted | PowerSGDHook | TopKHook = PowerSGDHook(
            model.module, config.rank, config.warmup_steps, traffic, seed=seed, group=group)
    elif config.name == "topk":
        state = TopKHook(model.module, config.ratio, traffic, group=group)
    else:
        state = _Counted(config.name, traffic, group)
    model.register_comm_hook(state, type(state).hook)
    return state
