"""torch.compile, applied where it composes with each strategy.

- Replicas (ddp, zero1, local_sgd, diloco): the whole model, after DDP has wrapped it, so
  that torch's DDP graph splitting puts bucket boundaries between graphs and the gradient
  all-reduce still overlaps backward.
- Split models (zero2, fsdp, tp, pp): each block on its own, after tensor parallelism and
  activation checkpointing and before FSDP shards it (torchtitan's order), so FSDP's
  all-gathers and reduce-scatters stay between the compiled blocks. A model without blocks
  is compiled whole.

``Module.compile`` compiles in place: the module keeps its class and its parameter names,
so checkpoints and the strategy's own calls (``no_sync``, ``set_requires_gradient_sync``)
are the same with compile or without.
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module, blocks: list[nn.Module] | None = None) -> nn.Module:
    """Compile each of ``blocks`` in place, or ``model`` whole when there are none."""
    for module in blocks or [model]:
        module.compile()
    return model
