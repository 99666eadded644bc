"""The model's repeated blocks: the unit of FSDP sharding and of activation checkpointing."""

from __future__ import annotations

from torch import nn

from shoal.errors import UsageError


def find_blocks(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The modules of class ``class_names`` in forward order; by default the children of the
    model's ``blocks`` ModuleList (as in shoal.examples.gpt), or none when it has none."""
    if class_names:
        found = [m for m in model.modules()
                 if m is not model and type(m).__name__ in class_names]
        if not found:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise UsageError(f"trainer.blocks: the model has no module of class "
                             f"{', '.join(class_names)}; its classes are "
                             f"{', '.join(classes[:16])}")
        return found
    blocks = getattr(model, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []
