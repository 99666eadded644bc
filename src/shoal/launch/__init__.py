"""Launching workers on torch.distributed.elastic: `shoal run` and `shoal.spawn`."""

from shoal.launch.config import LaunchSpec
from shoal.launch.launcher import launch

__all__ = ["LaunchSpec", "launch"]
