"""Become the worker: for jobs whose scheduler started every worker process itself.

Under ``srun --ntasks-per-node=4``, ``mpirun -np 8`` or torchrun there is nothing left to
start: this process takes the environment torchrun would give a worker and replaces itself
with the same worker bootstrap the launcher runs (``python -m shoal.launch.worker``). The
scheduler, not shoal, then owns the processes: it collects their exit codes and signals
them, and shoal's restarts, hang watch and per-rank logs do not apply.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from shoal.clusters.detect import ClusterEnv
from shoal.launch.config import LaunchSpec
from shoal.launch.worker_start import worker_argv

IN_PLACE_VARIABLE = "SHOAL_IN_PLACE"
"""Tells the worker bootstrap that no shoal launcher is its parent (none to die with)."""


def worker_environment(cluster: ClusterEnv) -> dict[str, str]:
    """The variables a torchrun worker reads, from a per-process ``cluster``."""
    if not cluster.per_process:
        raise ValueError("worker_environment needs a per-process ClusterEnv")
    env = {
        "RANK": str(cluster.rank),
        "LOCAL_RANK": str(cluster.local_rank),
        "WORLD_SIZE": str(cluster.world_size),
        "MASTER_ADDR": cluster.master_addr,
        "MASTER_PORT": str(cluster.master_port),
    }
    if cluster.local_world_size is not None:
        env["LOCAL_WORLD_SIZE"] = str(cluster.local_world_size)
    if cluster.node_rank is not None:
        env["GROUP_RANK"] = str(cluster.node_rank)
    return env


def run_in_place(spec: LaunchSpec, cluster: ClusterEnv) -> NoReturn:
    """Replace this process with the worker running ``spec``'s script as ``cluster``'s rank."""
    os.environ.update(worker_environment(cluster))
    os.environ[IN_PLACE_VARIABLE] = "1"
    if (cluster.local_world_size or 1) > 1:
        # As the launcher does: several processes per node would each start a thread per core.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if spec.debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *worker_argv(spec)])
