"""shoal: take a PyTorch training job from one process to many, and keep it running."""

from shoal.runtime.collectives import (  # noqa: E402
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    reduce_scatter,
)
from shoal.runtime.dist import (  # noqa: E402
    DistEnv,
    cleanup,
    device,
    init,
    is_main,
    local_rank,
    rank,
    world_size,
)
from shoal.runtime.heartbeat import heartbeat  # noqa: E402
from shoal.runtime.info import info  # noqa: E402
from shoal.runtime.spawn import WorkerFailedError, spawn  # noqa: E402
from shoal.training.config import TrainerConfig  # noqa: E402
from shoal.training.harness import Harness, seed_everything  # noqa: E402
from shoal.training.trainer import Trainer  # noqa: E402
from shoal.version import __version__ as __version__  # noqa: E402

__all__ = [
    "DistEnv",
    "Harness",
    "Trainer",
    "TrainerConfig",
    "WorkerFailedError",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "cleanup",
    "device",
    "heartbeat",
    "info",
    "init",
    "is_main",
    "local_rank",
    "rank",
    "reduce_scatter",
    "seed_everything",
    "spawn",
    "world_size",
]
