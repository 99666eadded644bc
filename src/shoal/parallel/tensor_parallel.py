"""Tensor parallel: split each layer's weights across the ranks of a "tp" mesh (torch DTensor).

A plan maps module names to torch ``ParallelStyle`` objects and is handed to torch's
``parallelize_module``. Keys are names relative to the model, as in ``named_modules()``;
each dot-separated part may be a shell-style pattern, so ``"blocks.*.attn.q"`` means the
``attn.q`` of every block. The ready plan, ``transformer_plan``, is the Megatron split of a
transformer block: attention's q/k/v and the MLP's first layer are split by output features
(column-wise, each rank gets a share of the heads and of the hidden units), the two
projections back into the residual stream by input features (row-wise, their partial
outputs are summed by one all-reduce). Two all-reduces per block forward, two backward.
Everything outside the plan (embeddings, norms, the head) stays an ordinary replicated
tensor whose gradient is the same on every rank.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict
from torch import nn

from shoal.errors import UsageError

# DTensor is imported where it is used: a run's configuration reads TensorParallelConfig in
# the launcher, which has no use for it (about 0.5 s of imports).
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


class TensorParallelConfig(BaseModel):
    """Options of the ready transformer plan (``transformer_plan``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    shard_vocab: bool = False
    """Also split the token embedding (by vocabulary rows, outputs summed) and the output
    head (by vocabulary columns, logits gathered): saves two vocab x d_model matrices'
    worth of memory per rank for one all-reduce and one all-gather more per step. Needs
    vocab_size divisible by the tp degree."""


def transformer_plan(config: TensorParallelConfig | None = None) -> dict[str, ParallelStyle]:
    """The plan for a model with ``blocks[i].attn.{q,k,v,proj}`` and ``blocks[i].mlp.{fc,proj}``.

    A starting point for other plans: ``{**transformer_plan(), "blocks.*.mlp.fc": ...}``.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = config or TensorParallelConfig()
    plan: dict[str, ParallelStyle] = {
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
    }
    if config.shard_vocab:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, config: TensorParallelConfig | None = None,
             *, plan: dict[str, ParallelStyle] | None = None) -> nn.Module:
    """Split ``model``'s layers across ``tp_mesh`` (1-D) in place and return it.

    ``plan`` (module-name pattern -> ParallelStyle, see the module docstring) replaces the
    ready ``transformer_plan(config)``; give one or the other. Every rank must call this
    with the same model; rank 0's weights are the ones kept. The plan is checked first
    (every key names a module, attention heads divide evenly), so an error leaves the model
    untouched. Parameters become DTensors: gather one with ``.full_tensor()``.
    """
    if tp_mesh.ndim != 1:
        raise UsageError(f"apply_tp needs a 1-D mesh, got {tp_mesh.ndim} dimensions "
                         f"{tp_mesh.mesh_dim_names}: pass the sub-mesh, e.g. mesh['tp']")
    if plan is not None and config is not None:
        raise UsageError("apply_tp got both a plan and a TensorParallelConfig; the config only "
                         "shapes the ready plan: pass one of them")
    if plan is None:
        plan = transformer_plan(config)
        if config is not None and config.shard_vocab:
            _check_vocab(model, tp_mesh.size())
    _check_plan(model, plan, tp_mesh.size())
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan)
    return model


def _matches(name: str, pattern: str) -> bool:
    """parallelize_module's rule: the same number of parts, each matched with fnmatch."""
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(
        fnmatch(part, p) for part, p in zip(parts, pattern_parts, strict=True))


def _check_plan(model: nn.Module, plan: dict[str, ParallelStyle], degree: int) -> None:
    names = [name for name, _ in model.named_modules() if name]
    planned: set[str] = set()
    for pattern in plan:
        matched = [name for name in names if _matches(name, pattern)]
        if pattern and not matched:
            example = next((n for n in names if n.count(".") == pattern.count(".")), names[0])
            raise UsageError(f"tensor-parallel plan key {pattern!r} names no module of "
                             f"{type(model).__name__}; names look like {example!r}")
        planned.update(matched)
    # Attention reshapes to (..., heads, head_dim): a rank must get whole heads.
    for name, module in model.named_modules():
        head_dim = getattr(module, "head_dim", None)
        q = getattr(module, "q", None)
        if not isinstance(head_dim, int) or not isinstance(q, nn.Linear):
            continue
        if not any(p == name or p.startswith(f"{name}.") for p in planned):
            continue
        heads = q.out_features // head_dim
        if heads % degree:
            raise UsageError(f"{name} has {heads} attention heads, which tensor parallelism "
                             f"cannot split over {degree} ranks: use a tp degree that divides "
                             f"{heads}, or a model with a multiple of {degree} heads")


def _check_vocab(model: nn.Module, degree: int) -> None:
    embedding = getattr(model, "tok_emb", None)  # absent: the plan check names the key
    vocab = embedding.num_embeddings if isinstance(embedding, nn.Embedding) else degree
    if vocab % degree:
        raise UsageError(f"shard_vocab splits the vocabulary ({vocab}) over {degree} ranks, "
                         f"which does not divide it: pad vocab_size to a multiple of {degree} "
                         "or set shard_vocab: false")
