"""Checkpoints on torch.distributed.checkpoint (DCP): atomic, validated, weights_only-safe."""

from shoal.checkpoint.store import CheckpointError, CheckpointStore

__all__ = ["CheckpointError", "CheckpointStore"]
