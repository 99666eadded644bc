"""Replicated data parallel for a split model: strategy 'ddp' with tensor or pipeline
parallelism.

torch's DistributedDataParallel holds tensor-parallel pieces as plain tensors between
forwards, and torch's pipeline schedules drive its reducer wrongly with microbatches. Its
FSDP2-based sibling, ``replicate`` (the one torch's pipeline schedules support), keeps
DTensors: each parameter is replicated over the dp ranks, and each block's gradients are
all-reduced as soon as its backward is done, as DDP's buckets are. Memory and traffic are
DDP's.
"""

from __future__ import annotations

from typing import cast

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh

from shoal.parallel.fsdp import FSDPConfig, FSDPTraffic, broadcast_from_first, local_numel
from shoal.parallel.traffic import Traffic, all_reduce_bytes


def apply_replicate(model: nn.Module, mesh: DeviceMesh,
                    blocks: list[nn.Module] | None = None) -> nn.Module:
    """Replicate ``model`` in place over the 1-D ``mesh`` (the dp ranks), each of ``blocks``
    one unit of gradient all-reduce and the rest of the model another. Every rank starts
    from the first one's parameters. Returns the model (now an FSDPModule: its
    ``set_requires_gradient_sync`` skips the all-reduce of accumulation micro-batches)."""
    broadcast_from_first(model, mesh.get_group())
    for block in blocks or []:
        replicate(block, mesh=mesh)
    # torch annotates a ReplicateModule (a mixin); it is the module, its class extended
    return cast(nn.Module, replicate(model, mesh=mesh))


class ReplicateTraffic(FSDPTraffic):
    """What ``apply_replicate`` sends: one all-reduce of the gradients per synced backward
    (counted from the parameter sizes, not timed)."""

    def __init__(self, model: nn.Module, traffic: Traffic, world_size: int):
        super().__init__(model, traffic, world_size, FSDPConfig(), reshard_after_forward=False)
        self.gather_bytes = 0.0
        self.scatter_bytes = all_reduce_bytes(local_numel(model) * 4, world_size)
