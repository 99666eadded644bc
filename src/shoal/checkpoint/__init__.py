"""Checkpoints on torch.distributed.checkpoint (DCP): atomic, validated, weights_only-safe.

The names below are imported on first use: a run's configuration checks a checkpoint's
files (``shoal.checkpoint.layout``) without importing DCP.
"""

from __future__ import annotations

from shoal.lazy import lazy_names

_LAZY = {
    "CheckpointError": "shoal.checkpoint.store",
    "CheckpointStore": "shoal.checkpoint.store",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
