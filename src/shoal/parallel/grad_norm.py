"""The gradient norm of a model split over ranks, and clipping to it.

torch's ``clip_grad_norm_`` needs all gradients of one kind: plain tensors, or DTensors of
one mesh. A tensor-parallel model has both (split weights are DTensors over the tp ranks;
norms and embeddings stay plain, the same on every tp rank), a sharded one adds the dp
ranks to the mesh of some of them, and a pipeline stage holds only its own layers. Here
each gradient's norm is made whole by its own DTensor (a plain one already is), squared
and summed, and the stages' sums are added over the pp ranks: every rank gets the norm
of the whole model's gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def total_norm(parameters: Iterable[nn.Parameter],
               pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of all gradients of the model these ``parameters`` are part of (fp32).

    ``pp_group``: the ranks holding the other pipeline stages, if any. Collective over
    the meshes of the DTensor gradients and over ``pp_group``.
    """
    squares = []
    device = None
    for param in parameters:
        device = param.device  # a DTensor's is its local tensor's
        if param.grad is None:
            continue
        norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.square())
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients so that their ``total_norm`` is at most ``max_norm`` (as torch's
    ``clip_grad_norm_``, same epsilon); returns the norm before clipping."""
    params = list(parameters)
    norm = total_norm(params, pp_group)
    params = [p for p in params if p.grad is not None]
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for param in params:
        assert param.grad is not None  # kept above only with a gradient
        param.grad.mul_(coefficient)
    return norm
