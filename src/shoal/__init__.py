"""shoal: take a PyTorch training job from one process to many, and keep it running.

The names below are imported on first use, so that ``import shoal.<anything>`` (the command
line, the launcher, a worker's bootstrap) does not pay for torch's checkpoint, pipelining and
compiler modules unless it uses them.
"""

# ruff: noqa: F401 - the imports under TYPE_CHECKING are the names of __all__, for editors
from __future__ import annotations

from shoal.lazy import lazy_names
from shoal.version import __version__ as __version__

# typing is not imported: a worker of `shoal run` imports this package before the user's
# script, and pays for every import here.
TYPE_CHECKING = False

_LAZY = {
    "all_gather": "shoal.runtime.collectives",
    "all_gather_object": "shoal.runtime.collectives",
    "all_reduce": "shoal.runtime.collectives",
    "barrier": "shoal.runtime.collectives",
    "broadcast": "shoal.runtime.collectives",
    "broadcast_object": "shoal.runtime.collectives",
    "reduce_scatter": "shoal.runtime.collectives",
    "DistEnv": "shoal.runtime.dist",
    "cleanup": "shoal.runtime.dist",
    "device": "shoal.runtime.dist",
    "init": "shoal.runtime.dist",
    "is_main": "shoal.runtime.dist",
    "local_rank": "shoal.runtime.dist",
    "rank": "shoal.runtime.dist",
    "world_size": "shoal.runtime.dist",
    "heartbeat": "shoal.runtime.heartbeat",
    "info": "shoal.runtime.info",
    "WorkerFailedError": "shoal.launch.spawn",
    "spawn": "shoal.launch.spawn",
    "TrainerConfig": "shoal.training.config",
    "Callback": "shoal.training.callbacks",
    "BestCheckpoints": "shoal.training.best_checkpoints",
    "EarlyStopping": "shoal.training.early_stopping",
    "Harness": "shoal.training.harness",
    "Tracker": "shoal.metrics.tracker",
    "seed_everything": "shoal.runtime.seeds",
    "Trainer": "shoal.training.trainer",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())


if TYPE_CHECKING:  # what type checkers and editors see
    from shoal.launch.spawn import WorkerFailedError, spawn
    from shoal.metrics.tracker import Tracker
    from shoal.runtime.collectives import (
        all_gather,
        all_gather_object,
        all_reduce,
        barrier,
        broadcast,
        broadcast_object,
        reduce_scatter,
    )
    from shoal.runtime.dist import (
        DistEnv,
        cleanup,
        device,
        init,
        is_main,
        local_rank,
        rank,
        world_size,
    )
    from shoal.runtime.heartbeat import heartbeat
    from shoal.runtime.info import info
    from shoal.runtime.seeds import seed_everything
    from shoal.training.best_checkpoints import BestCheckpoints
    from shoal.training.callbacks import Callback
    from shoal.training.config import TrainerConfig
    from shoal.training.early_stopping import EarlyStopping
    from shoal.training.harness import Harness
    from shoal.training.trainer import Trainer
