"""ZeRO-1: optimizer state sharded over the dp ranks; gradients all-reduced, weights replicated.

torch's ZeroRedundancyOptimizer is the engine: each rank keeps the optimizer state of its
share of the parameters (whole parameters, balanced by size), steps them, and broadcasts
the updated weights to the others. Gradients are all-reduced by DDP as under 'ddp', so the
updates are the very same as 'ddp''s, only the optimizer state is spread out.

Checkpoints hold the optimizer state in the same form as every other strategy (keyed by
parameter name, as ``torch.distributed.checkpoint.state_dict`` gives it), so a run saved
under 'zero1' continues under 'ddp' or 'fsdp' and the reverse.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shoal.errors import UsageError
from shoal.parallel.comm import Comm
from shoal.parallel.compression import CompressionConfig, apply_compression
from shoal.parallel.ddp import DDPConfig, apply_ddp
from shoal.parallel.traffic import Traffic, all_gather_bytes

if TYPE_CHECKING:
    # Imported when used: torch.distributed.optim compiles TorchScript when first imported
    # (a quarter of a second in every process, strategy or not).
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from shoal.parallel.compression import _Uncompressed


def apply_zero1(model: nn.Module, optimizer: torch.optim.Optimizer,
                group: dist.ProcessGroup | None = None, *, device: torch.device,
                ddp: DDPConfig | None = None
                ) -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
    """Wrap ``model`` in DDP over ``group`` (the dp ranks; default: all) and replace
    ``optimizer`` by a ZeroRedundancyOptimizer of the same class, groups and settings."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if optimizer.state:
        raise UsageError("the optimizer has already stepped: set up the model before "
                         "training, with a fresh optimizer")
    model = apply_ddp(model, device, ddp, process_group=group)
    # Copies of the groups: the new optimizer owns its settings (a scheduler must be built
    # on it, not on the optimizer it replaces).
    groups = [dict(g) for g in optimizer.param_groups]
    zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=group,
                                   **_constructor_settings(optimizer))
    return model, zero


class ZeroTraffic(Comm):
    """What a rank sends under zero1: DDP's gradient all-reduce (counted as under 'ddp'),
    then, after each step, ZeRO's broadcast of every rank's updated share of the weights
    (an all-gather in bytes; counted from the sizes, not timed)."""

    def __init__(self, model: DistributedDataParallel, traffic: Traffic):
        self.all_reduce = cast("_Uncompressed",  # compression 'none'
                               apply_compression(model, CompressionConfig(), traffic))
        world = dist.get_world_size(model.process_group)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.broadcast_bytes = all_gather_bytes(nbytes / world, world)
        self.traffic = traffic

    def after_backward(self) -> None:
        self.all_reduce.after_backward()

    def after_step(self) -> None:
        self.traffic.sent(self.broadcast_bytes)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def is_zero(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer`` is a ZeroRedundancyOptimizer (without importing it when none is)."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def _constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW's defaults include a
    'decoupled_weight_decay' it sets itself)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}


def _names(model: nn.Module) -> dict[int, str]:
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return {id(p): n for n, p in module.named_parameters()}


def _parameters(zero: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    return [p for group in zero.param_groups for p in group["params"]]


def gather_optimizer_state(model: nn.Module, zero: ZeroRedundancyOptimizer) -> dict:
    """The whole optimizer state on every rank, keyed by parameter name like
    ``get_optimizer_state_dict``'s: {'state': {name: {...}}, 'param_groups': [...]}.

    Collective. Each rank broadcasts the state of the parameters it owns; for the moment of
    a save every rank holds all of it (the price of one form for every strategy).
    """
    names = _names(model)
    by_name = {names[id(p)]: p for p in _parameters(zero)}
    mine = {names[id(p)]: state for p, state in zero.optim.state.items() if state}
    shapes = {name: {k: (v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor) else v
                     for k, v in state.items()} for name, state in mine.items()}
    everyone: list[Any] = [None] * zero.world_size
    dist.all_gather_object(everyone, shapes, group=zero.process_group)
    gathered: dict[str, dict] = {}
    for owner, described in enumerate(everyone):
        src = dist.get_global_rank(zero.process_group, owner)
        for name, entries in described.items():
            state = gathered[name] = {}
            for key, value in entries.items():
                if not isinstance(value, tuple):  # a number, not a tensor
                    state[key] = value
                    continue
                # Sent from the parameter's device (NCCL sends GPU tensors only), kept
                # where the owner keeps it (Adam's 'step' is a CPU scalar).
                shape, dtype, where = value
                device = by_name[name].device
                tensor = mine[name][key].to(device) if owner == zero.rank else \
                    torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=src, group=zero.process_group)
                tensor = mine[name][key] if owner == zero.rank else tensor.to(where)
                state[key] = tensor
    order = [names[id(p)] for p in _parameters(zero)]
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [names[id(p)] for p in g["params"]]} for g in zero.param_groups]
    return {"state": {n: gathered[n] for n in order if n in gathered}, "param_groups": groups}


def load_optimizer_state(model: nn.Module, zero: ZeroRedundancyOptimizer, state: dict) -> None:
    """Load a name-keyed optimizer state (from any strategy): each rank keeps its share."""
    names = _names(model)
    index = {names[id(p)]: i for i, p in enumerate(_parameters(zero))}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise UsageError(f"the checkpoint's optimizer has state for parameters the model does "
                         f"not have: {', '.join(unknown[:8])}")
    zero.load_state_dict({
        "state": {index[n]: s for n, s in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                         for g in state["param_groups"]]})


def local_optimizer_state(zero: ZeroRedundancyOptimizer) -> dict:
    """This rank's share of the optimizer state and the groups' settings (learning rate,
    ...), without talking to the other ranks: what rank r of a group gives rank r of
    another group that has the same layout (see ``load_local_optimizer_state``)."""
    return {"local": zero.optim.state_dict(),
            "groups": [{k: v for k, v in g.items() if k != "params"}
                       for g in zero.param_groups]}


def load_local_optimizer_state(zero: ZeroRedundancyOptimizer, state: dict) -> None:
    zero.optim.load_state_dict(state["local"])
    for group, settings in zip(zero.param_groups, state["groups"], strict=True):
        group.update(settings)
