"""Models built on the meta device: each rank allocates and initialises only its part.

A model too large for one device is built without memory (``with torch.device("meta")``),
split by the strategy and the topology (FSDP shards, tensor-parallel pieces, a pipeline
stage), and only then given storage. Its initial values must be the ones the whole model
would get, on every rank alike: the model says what each parameter's whole initial value
is (``init_parameter(name, tensor)``, deterministic by name, as ``shoal.examples.gpt.GPT``
has), and each rank computes it one parameter at a time and keeps its piece.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shoal.errors import UsageError

Init = Callable[[str, torch.Tensor], None]


def on_meta(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device (all of them must be)."""
    flags = {p.is_meta for p in model.parameters()}
    if len(flags) > 1:
        raise UsageError("some of the model's parameters are on the meta device and some "
                         "are not: build all of it on the meta device, or none")
    return flags == {True}


def initializer(model: nn.Module) -> Init:
    """The model's ``init_parameter``, checked to exist; buffers must not be on meta."""
    init = getattr(model, "init_parameter", None)
    if not callable(init):
        raise UsageError(f"{type(model).__name__} is on the meta device but has no "
                         "init_parameter(name, tensor) to give each parameter its initial "
                         "value: add one (see shoal.examples.gpt.GPT), or build the model "
                         "on the CPU")
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise UsageError(f"buffers on the meta device have no initial value: "
                         f"{', '.join(meta_buffers[:4])}; register them after building")
    return init


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, init: Init) -> nn.Module:
    """Give ``module``'s meta parameters storage on ``device`` and their initial values:
    ``init(name, whole)`` fills a whole parameter (on the CPU, one at a time) and this
    rank keeps its piece of it (a DTensor's local shard). Returns the module; parameter
    objects may be new, so an optimizer must follow them (by name)."""
    module.to_empty(device=device)
    for name, param in module.named_parameters():
        whole = torch.empty(param.shape, dtype=param.dtype)
        init(name, whole)
        if isinstance(param, DTensor):
            piece = distribute_tensor(whole, param.device_mesh, param.placements,
                                      src_data_rank=None)  # each rank cuts its own piece
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(whole)
    return module
