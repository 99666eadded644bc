"""Process-group lifecycle and rank queries.

The launcher's environment (RANK, WORLD_SIZE, ...) is read once, in ``init``, into a
``DistEnv``. Without a launcher, ``init`` makes a one-process group so that the same code
(collectives, DDP) runs unchanged under plain ``python script.py``.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.errors import UsageError

_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DistEnv:
    """What the launcher told this process about its place in the job.

    Never raises.
    """

    rank: int = 0
    """Global rank of this process."""
    local_rank: int = 0
    """Rank of this process on its node; picks the GPU."""
    world_size: int = 1
    """Number of processes in the job."""
    local_world_size: int = 1
    """Number of processes on this node."""
    launched: bool = False
    """True when a launcher (shoal run, torchrun) set the environment."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls()
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            launched=True,
        )


_env: DistEnv | None = None
_device: torch.device | None = None


def resolve_backend(backend: str | None) -> str:
    """NCCL when CUDA is available, gloo otherwise, unless the caller names one."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in _BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("backend 'nccl' needs CUDA, and no CUDA device is visible; use 'gloo'")
    return backend


def check_gpus(backend: str | None, processes: int) -> None:
    """Refuse more NCCL processes on this node than GPUs it sees (NCCL needs one GPU per
    process: two on one GPU fail with "Duplicate GPU detected", one without a GPU with
    "invalid device ordinal"). Called by the launcher before any worker starts."""
    if resolve_backend(backend) != "nccl":
        return
    visible = torch.cuda.device_count()
    if processes > visible:
        raise UsageError(
            f"{processes} processes on this node need {processes} GPUs under NCCL, but "
            f"{visible} {'is' if visible == 1 else 'are'} visible: start {visible} "
            f"process{'' if visible == 1 else 'es'} (--nproc-per-node {visible}), or train "
            "on the CPU with trainer.backend: gloo")


def init(backend: str | None = None, timeout: float | None = None) -> DistEnv:
    """Join the job's process group (once; later calls return the same DistEnv).

    Raises:
        UsageError: If ``backend`` is not 'gloo' or 'nccl', is 'nccl' with no CUDA device
            visible, or this node runs more NCCL processes than it has GPUs.
        ValueError: If the launcher's environment is incomplete (e.g. RANK and WORLD_SIZE
            set, MASTER_ADDR not).
        RuntimeError: If the group cannot form: the rendezvous store is unreachable, or the
            other ranks do not join within ``timeout`` (torch's DistNetworkError,
            DistStoreError).
    """
    global _env, _device
    if _env is not None and dist.is_initialized():
        return _env
    env = DistEnv.from_environ()
    backend = resolve_backend(backend)
    if backend == "nccl":
        check_gpus(backend, env.local_world_size)  # a script started by shoal run
        _device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(_device)
    else:
        _device = torch.device("cpu")
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if not dist.is_initialized():
        if env.launched:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kwargs)
        else:
            # No launcher: a group of one, so collectives and DDP work the same way.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    **kwargs)
        # Destroying the group before exit avoids an abort in gloo's teardown.
        atexit.register(cleanup)
    _env = env
    return env


def cleanup() -> None:
    """Leave the process group; safe to call when not initialized.

    Never raises.
    """
    global _env, _device
    if dist.is_initialized():
        dist.destroy_process_group()
    _env = None
    _device = None


def is_initialized() -> bool:
    return _env is not None and dist.is_initialized()


def rank() -> int:
    """Global rank (0 outside a job).

    Never raises.
    """
    if dist.is_initialized():
        return dist.get_rank()
    return DistEnv.from_environ().rank


def local_rank() -> int:
    """Rank on this node (0 outside a job).

    Never raises.
    """
    return (_env or DistEnv.from_environ()).local_rank


def world_size() -> int:
    """Number of processes (1 outside a job).

    Never raises.
    """
    if dist.is_initialized():
        return dist.get_world_size()
    return DistEnv.from_environ().world_size


def is_main() -> bool:
    """True on global rank 0, the process that logs, shows progress and writes files.

    Never raises.
    """
    return rank() == 0


def device() -> torch.device:
    """The device this process computes on (its GPU under NCCL, else the CPU).

    Never raises.
    """
    if _device is not None:
        return _device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None
