"""`shoal.info()` and `shoal env`: the facts a bug report needs."""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import torch

from shoal.runtime import dist as _dist
from shoal.version import __version__

_ENV_PREFIXES = ("MASTER_", "RANK", "LOCAL_", "WORLD_SIZE", "GROUP_", "ROLE_", "TORCHELASTIC_",
                 "NCCL_", "GLOO_", "TORCH_", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                 "SLURM_", "OMPI_COMM_WORLD_", "PMI_", "SHOAL_")


def info() -> dict[str, Any]:
    """Backend, world size, rank, devices and versions of this process.

    Never raises.
    """
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    return {
        "backend": _dist.backend(),
        "initialized": _dist.is_initialized(),
        "world_size": _dist.world_size(),
        "rank": _dist.rank(),
        "local_rank": _dist.local_rank(),
        "device": str(_dist.device()),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "hostname": socket.gethostname(),
        "versions": {
            "shoal": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "nccl": nccl,
        },
        "backends_available": {
            "gloo": torch.distributed.is_gloo_available(),
            "nccl": torch.distributed.is_nccl_available() and cuda,
        },
    }


def network_interfaces() -> dict[str, list[str]]:
    """IPv4/IPv6 addresses of each interface, for choosing MASTER_ADDR."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[name] = [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    return out


def relevant_environment() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}


def print_env_report() -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    data = info()
    table = Table(title="shoal env", show_header=False)
    for key, value in data.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        table.add_row(key, str(value))
    table.add_row("platform", platform.platform())
    table.add_row("cpus", str(os.cpu_count()))
    for name, addrs in network_interfaces().items():
        table.add_row(f"interface {name}", ", ".join(addrs) or "-")
    for key, value in relevant_environment().items():
        table.add_row(f"${key}", value)
    console.print(table)
