"""Checkpoints on torch.distributed.checkpoint (DCP): atomic, validated, weights_only-safe.

The names below are imported on first use: a run's configuration checks a checkpoint's
files (``shoal.checkpoint.layout``) without importing DCP.
"""

from __future__ import annotations

from shoal.lazy import lazy_names

TYPE_CHECKING = False  # as in shoal/__init__.py, without importing typing

_LAZY = {
    "CheckpointError": "shoal.checkpoint.store",
    "CheckpointStore": "shoal.checkpoint.store",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # what type checkers and editors see
    from shoal.checkpoint.store import CheckpointError as CheckpointError
    from shoal.checkpoint.store import CheckpointStore as CheckpointStore


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
