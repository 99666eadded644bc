"""The launch specification: one validated dataclass built at the command line's edge."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from shoal.errors import UsageError
from shoal.ft import FaultToleranceConfig


def resolve_nproc(value: int | str) -> int:
    """Turn ``--nproc-per-node`` into a count: ``auto`` is one per GPU, else one per CPU core
    this process may run on."""
    if isinstance(value, str):
        if value == "auto":
            import torch

            if torch.cuda.is_available():
                return torch.cuda.device_count()
            return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else os.cpu_count() or 1
        try:
            value = int(value)
        except ValueError:
            raise UsageError(
                f"--nproc-per-node must be a whole number or 'auto', not {value!r}"
            ) from None
    return value


@dataclass
class LaunchSpec:
    """What to run and on how many processes; read once from the command line."""

    entry: str
    """The script path, or the module name when ``module`` is true."""
    args: list[str] = field(default_factory=list)
    """Arguments passed to the script unchanged."""
    module: bool = False
    """Run ``entry`` as a module (``python -m entry``)."""
    nproc_per_node: int = 1
    """Worker processes on this node."""
    nnodes: int = 1
    """Number of nodes (machines) taking part; with ``min_nodes``, the most."""
    min_nodes: int | None = None
    """Elastic membership (``--nnodes MIN:MAX``): the job runs on as few as this many nodes;
    a node that dies is dropped at the next restart, one that joins is taken in. None: all
    ``nnodes`` nodes, always."""
    node_rank: int = 0
    """This node's index in ``[0, nnodes)``."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the rendezvous store runs."""
    master_port: int | None = None
    """Port of the rendezvous store; on one node, ``None`` picks a free one."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the c10d rendezvous store (dynamic membership), instead of the
    static ``master_addr``/``master_port``. Node ranks are then assigned at each rendezvous."""
    rdzv_id: str | None = None
    """The job's name at the c10d rendezvous: every node of one job gives the same."""
    rdzv_host: bool = False
    """This node hosts the c10d store (found out from its addresses when not given)."""
    rdzv_last_call: float = 10.0
    """Seconds a rendezvous waits for more nodes once ``min_nodes`` are there."""
    max_restarts: int = 0
    """How many times the whole worker group is restarted after a failure."""
    log_dir: str | None = None
    """Directory that keeps one stdout/stderr log per rank; a temporary one if not given."""
    monitor_interval: float = 0.1
    """Seconds between checks of the workers' state."""
    hang_timeout: float | None = 600.0
    """Report and stop the job when no rank made progress for this long (None: never)."""
    debug: bool = False
    """Check every collective across ranks (operation, shapes, dtypes); slower."""
    replica_groups: int = 1
    """Live mode: this many replica groups on this node, each its own agent and workers
    (``nproc_per_node`` each) and its own restarts (the job has ``nnodes`` times as many)."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Restart (default) or live recovery, and live mode's policy and timeouts."""
    preload: bool = True
    """Fork the workers from a server that has imported torch once (Linux), so that a
    restarted worker starts in a fraction of a second; False: each worker is a new
    ``python`` process (shoal.launch.worker_start)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(
                f"--nproc-per-node must be at least 1, got {self.nproc_per_node}"
            )
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, "
                f"got {self.node_rank}"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise UsageError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got "
                             f"{self.min_nodes}:{self.nnodes}")
        if self.rdzv_endpoint is not None:
            self._check_rdzv()
        elif self.min_nodes is not None and self.min_nodes < self.nnodes:
            raise UsageError("--nnodes MIN:MAX (elastic) needs c10d rendezvous: give "
                             "--rdzv-endpoint HOST:PORT and --rdzv-id JOB")
        elif self.nnodes > 1 and self.master_port is None:
            raise UsageError("--master-port is required when --nnodes is more than 1")
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise UsageError(f"--hang-timeout must be positive, got {self.hang_timeout}")
        if self.replica_groups < 1:
            raise UsageError(f"--replica-groups must be at least 1, got {self.replica_groups}")
        if self.fault_tolerance.live and (self.elastic or self.min_nodes is not None):
            raise UsageError("live mode across nodes runs one replica group per node, which "
                             "come and go by themselves: give --nnodes N with --node-rank, "
                             "--master-addr and --master-port, not --rdzv-endpoint or "
                             "--nnodes MIN:MAX")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if not self.module and not os.path.isfile(self.entry):
            raise UsageError(f"script not found: {self.entry}")
        if self.module:
            self._check_module_importable()

    def _check_rdzv(self) -> None:
        host, _, port = (self.rdzv_endpoint or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")
        if not self.rdzv_id:
            raise UsageError("--rdzv-endpoint needs --rdzv-id JOB (the same on every node)")
        if self.rdzv_last_call < 0:
            raise UsageError(f"--rdzv-last-call must be 0 or more, got {self.rdzv_last_call}")

    @property
    def elastic(self) -> bool:
        """Node ranks come from a c10d rendezvous rather than from ``node_rank``."""
        return self.rdzv_endpoint is not None

    def _check_module_importable(self) -> None:
        import importlib.util

        try:
            found = importlib.util.find_spec(self.entry)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise UsageError(f"module not found: {self.entry}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node
