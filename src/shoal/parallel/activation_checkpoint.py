"""Activation checkpointing: keep each block's input only, recompute its inside in backward.

Memory for activations drops from every layer's to one block's at a time, for about one
more forward pass of compute. torch's composable ``checkpoint`` (non-reentrant
torch.utils.checkpoint, installed as forward hooks) is the engine: unlike a wrapper module
it leaves parameter names alone, so checkpoints and state dicts are the same with it or
without it. It composes with DDP and FSDP2; apply it before FSDP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from shoal.errors import UsageError


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> nn.Module:
    """Checkpoint the activations of each of ``blocks`` (modules of ``model``), in place."""
    if not blocks:
        raise UsageError("activation_checkpointing needs the model's blocks: give the model a "
                         "'blocks' ModuleList, or name their class in trainer.blocks")
    for block in blocks:
        checkpoint(block)
    return model
