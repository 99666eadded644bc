"""Sharded data parallel: parameters, gradients and optimizer state split over the dp ranks.

torch's FSDP2 (``fully_shard``) is the engine. Each block is one unit: its parameters are
all-gathered just before its forward (and again before its backward) and its gradients are
reduce-scattered right after its backward, so one block at a time is whole in memory. The
root unit holds what no block does (embeddings, final norm, head).

- strategy 'fsdp' (ZeRO-3): a block's parameters are freed again after its forward.
- strategy 'zero2': they stay gathered from forward to backward (no second all-gather), so
  only gradients and optimizer state stay sharded between steps.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from shoal.errors import UsageError
from shoal.parallel.blocks import find_blocks
from shoal.parallel.comm import Comm
from shoal.parallel.traffic import Traffic, all_gather_bytes

# FSDP and DTensor are imported where they are used: a run's configuration reads FSDPConfig
# in the launcher, which has no use for them (about 0.5 s of imports).
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class FSDPConfig(BaseModel):
    """Settings of the sharded strategies 'zero2' and 'fsdp'."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    cpu_offload: bool = False
    """Keep the parameter shards, gradients and optimizer step in CPU memory (for a model
    on a GPU; on a CPU-only machine there is nothing to move)."""
    mixed_precision: bool = False
    """Compute with bf16 copies of the parameters and reduce gradients in fp32; the
    sharded parameters and the optimizer state stay fp32."""


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, config: FSDPConfig | None = None, *,
               blocks: list[nn.Module] | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``mesh`` (the dp ranks): each of ``blocks``
    (default: ``find_blocks(model)``) is one unit, the rest of the model is the root unit.

    Without blocks the whole model is one unit, whole in memory during forward and backward.
    As under DDP, every rank starts from rank 0's weights. The parameters become DTensors:
    an optimizer must hold the new ones (see ``follow_parameters``). Returns the model, now
    also an FSDPModule.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    config = config or FSDPConfig()
    if mesh.size() > 1:
        broadcast_from_first(model, mesh.get_group())
    options: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if config.mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    if config.cpu_offload:
        # Pinned memory needs an accelerator; without one, plain CPU memory.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in find_blocks(model) if blocks is None else blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def broadcast_from_first(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of ``group`` (default: all) the parameters and buffers of its first
    rank. A tensor already split by tensor parallelism (a DTensor) is the same piece on
    every rank of a dp group (one tp coordinate): that piece is what is sent."""
    from torch.distributed.tensor import DTensor

    first = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if not local.is_meta:  # meta: no values yet (see shoal.parallel.materialize)
                dist.broadcast(local, src=first, group=group)


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The name of each parameter of each of ``optimizer``'s groups, in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise UsageError("the optimizer holds a parameter that is not the model's: build it "
                         "from model.parameters()") from None


def follow_parameters(model: nn.Module, optimizer: torch.optim.Optimizer,
                      names: list[list[str]], only_present: bool = False) -> None:
    """Point ``optimizer``'s groups at the parameters now named ``names`` in ``model``.

    FSDP and tensor parallelism replace each parameter by a sharded one of the same name;
    a pipeline stage holds only some of them (``only_present``: the others are dropped).
    The optimizer object stays the same, so a scheduler or hook bound to it keeps working.
    """
    if optimizer.state:
        raise UsageError("the optimizer has already stepped: set up the model before "
                         "training, with a fresh optimizer")
    params = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        group["params"] = [params[n] for n in group_names if not only_present or n in params]


def local_numel(model: nn.Module) -> int:
    """Parameter elements on this rank: of a tensor-parallel piece, the piece."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel()
               for p in model.parameters())


class FSDPTraffic(Comm):
    """What a rank sends under FSDP, counted from the parameter sizes in the ring model of
    ``shoal.parallel.traffic`` (FSDP issues its collectives itself; their wait is not
    timed): per backward, one all-gather of the parameters for forward and, under 'fsdp',
    another for backward (they were freed in between); then one reduce-scatter of the
    gradients, unless ``syncing`` is off (accumulation micro-batches)."""

    def __init__(self, model: nn.Module, traffic: Traffic, world_size: int,
                 config: FSDPConfig, reshard_after_forward: bool):
        numel = local_numel(model)
        gathered = 2 if config.mixed_precision else 4  # bytes per element: bf16 or fp32
        passes = 2 if reshard_after_forward else 1
        self.gather_bytes = passes * all_gather_bytes(numel * gathered / world_size, world_size)
        self.scatter_bytes = (world_size - 1) / world_size * numel * 4
        self.traffic = traffic
        self.syncing = True

    def after_backward(self) -> None:
        self.traffic.sent(self.gather_bytes + (self.scatter_bytes if self.syncing else 0))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
