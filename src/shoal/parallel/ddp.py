"""Data parallel: replicate the model, all-reduce gradients (torch DistributedDataParallel)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shoal.errors import UsageError


class DDPConfig(BaseModel):
    """Options passed to torch's DistributedDataParallel."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    bucket_cap_mb: float | None = Field(None, gt=0)
    """Gradients are all-reduced in buckets of about this many megabytes (torch's default,
    25 with a small first bucket, when not set)."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in some steps (costs a graph walk per step)."""
    static_graph: bool = False
    """Promise the same graph every step, enabling DDP's static-graph optimizations."""
    gradient_as_bucket_view: bool = False
    """Let gradients alias the communication buckets to save one copy of the gradients."""
    sync_batchnorm: bool = False
    """Turn BatchNorm layers into SyncBatchNorm: batch statistics over the global batch
    instead of each rank's share (one all-reduce per BatchNorm layer per forward)."""


def apply_ddp(model: nn.Module, device: torch.device, config: DDPConfig | None = None,
              process_group: dist.ProcessGroup | None = None) -> DistributedDataParallel:
    """Wrap ``model`` (already on ``device``) in DistributedDataParallel over
    ``process_group`` (default: every rank)."""
    config = config or DDPConfig()
    if config.sync_batchnorm:
        if device.type == "cpu":
            raise UsageError("trainer.ddp.sync_batchnorm: torch's SyncBatchNorm runs on GPUs "
                             "only; unset it for a CPU job")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
    device_ids = [device.index] if device.type == "cuda" else None
    # Passing bucket_cap_mb at all turns off DDP's small first bucket: only pass it when set.
    buckets: dict[str, Any] = ({} if config.bucket_cap_mb is None
                               else {"bucket_cap_mb": config.bucket_cap_mb})
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        **buckets,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )
