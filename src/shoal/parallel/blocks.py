"""The model's repeated blocks: the unit of FSDP sharding and of activation checkpointing."""

from __future__ import annotations

from torch import nn

from shoal.errors import UsageError


def find_blocks(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The modules of class ``class_names`` in forward order. By default, the first that
    exists of: the children of the model's ``blocks`` ModuleList (as in shoal.examples.gpt);
    the modules of the classes the model names in ``_no_split_modules`` (a transformers
    model's layer classes, e.g. GPT2Block, LlamaDecoderLayer) that repeat in a ModuleList;
    the children of the model's longest ModuleList of one class (BERT's encoder layers);
    none."""
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
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and len({type(child) for child in m}) == 1]
    named = set(getattr(model, "_no_split_modules", None) or ())
    # A class named there may also be a one-off (BERT names its embeddings): only those
    # that repeat are the layers.
    layers = [child for m in lists for child in m if type(child).__name__ in named]
    if layers:
        return layers
    # ignore: mypy infers max's type from list()'s context (Iterable[Module]), not from lists
    return list(max(lists, key=len)) if lists else []  # type: ignore[arg-type]
