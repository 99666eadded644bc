"""Collectives over the default process group, with string ops and gloo-safe averaging."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shoal.errors import UsageError

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
OPS = (*_OPS, "avg")


# torch 2.13 renamed all_gather_into_tensor (one output tensor, W x the input) and warns on
# the old name; older releases have only the old one.
gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_op(op: str) -> dist.ReduceOp.RedOpType:
    if op not in OPS:
        raise UsageError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return _OPS.get(op, dist.ReduceOp.SUM)


def _check_avg(tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise UsageError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it. ``avg`` works on every backend.

    Raises:
        UsageError: If ``op`` is not one of sum, max, min, product, avg, or ``avg`` gets a
            tensor that is not floating-point.
        ValueError: If the process group is not initialized (call ``shoal.init()`` first).
        RuntimeError: If the collective fails, e.g. a peer died or the group's timeout
            passed (torch's DistBackendError).
    """
    reduce_op = _reduce_op(op)
    if op == "avg":
        _check_avg(tensor)
    dist.all_reduce(tensor, op=reduce_op)
    if op == "avg":
        # gloo has no AVG; summing then dividing gives the same result on every backend.
        tensor.div_(dist.get_world_size())
    return tensor


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), indexed by rank.

    Raises:
        ValueError: If the process group is not initialized (call ``shoal.init()`` first).
        RuntimeError: If the collective fails, e.g. a peer died or the group's timeout
            passed (torch's DistBackendError).
    """
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s, in place, and return it.

    Raises:
        ValueError: If the process group is not initialized (call ``shoal.init()`` first).
        RuntimeError: If ``src`` is not a rank of the job, or the collective fails (e.g. a
            peer died or the group's timeout passed).
    """
    dist.broadcast(tensor, src=src)
    return tensor


def reduce_scatter(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's slice of dim 0.

    Dim 0 must divide by the world size; rank r receives rows ``[r*n/W, (r+1)*n/W)``.

    Raises:
        UsageError: If dim 0 of ``tensor`` does not divide by the world size (or it has no
            dim 0), ``op`` is not one of sum, max, min, product, avg, or ``avg`` gets a
            tensor that is not floating-point.
        ValueError: If the process group is not initialized (call ``shoal.init()`` first).
        RuntimeError: If the collective fails, e.g. a peer died or the group's timeout
            passed (torch's DistBackendError).
    """
    world = dist.get_world_size()
    if tensor.dim() == 0 or tensor.shape[0] % world:
        raise UsageError(
            f"reduce_scatter needs dim 0 divisible by the world size {world}, "
            f"got shape {tuple(tensor.shape)}"
        )
    reduce_op = _reduce_op(op)
    if op == "avg":
        _check_avg(tensor)
    out = torch.empty((tensor.shape[0] // world, *tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    if dist.get_backend() == "gloo":
        # gloo has no native reduce-scatter: all-reduce a copy and keep this rank's slice.
        full = tensor.clone()
        dist.all_reduce(full, op=reduce_op)
        out.copy_(full.chunk(world)[dist.get_rank()])
    else:
        dist.reduce_scatter_tensor(out, tensor.contiguous(), op=reduce_op)
    if op == "avg":
        out.div_(world)
    return out


def barrier() -> None:
    """Wait until every rank reaches this point.

    Raises:
        ValueError: If the process group is not initialized (call ``shoal.init()`` first).
        RuntimeError: If a peer died or the group's timeout passed before every rank came.
    """
    dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, indexed by rank.

    Raises:
        ValueError: If the process group is not initialized (call ``shoal.init()`` first).
        RuntimeError: If the collective fails, e.g. a peer died or the group's timeout
            passed (torch's DistBackendError).
        pickle.PicklingError: If ``obj`` cannot be pickled (some objects raise TypeError or
            AttributeError instead).
    """
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank.

    Raises:
        ValueError: If the process group is not initialized (call ``shoal.init()`` first).
        RuntimeError: If ``src`` is not a rank of the job, or the collective fails (e.g. a
            peer died or the group's timeout passed).
        pickle.PicklingError: If ``obj`` cannot be pickled on rank ``src`` (some objects raise
            TypeError or AttributeError instead).
    """
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
