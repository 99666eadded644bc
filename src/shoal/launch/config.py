"""The launch specification: one validated dataclass built at the command line's edge."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from shoal.errors import UsageError
from shoal.launch.scheduling import Scheduling

if TYPE_CHECKING:  # imported where live mode is used: the launcher's start does without it
    from shoal.ft import FaultToleranceConfig


DEFAULT_RDZV_PORT = 29400  # torchrun's, for a c10d endpoint given without a port


def with_port(endpoint: str) -> str:
    """``HOST:PORT`` for a c10d endpoint given as ``HOST`` (``[::1]`` too): torchrun's
    default port."""
    if ":" not in endpoint or endpoint.endswith("]"):
        return f"{endpoint}:{DEFAULT_RDZV_PORT}"
    return endpoint


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
        if value in ("cpu", "gpu"):  # as torchrun: one per CPU core, or one per GPU
            import torch

            if value == "gpu" and not torch.cuda.is_available():
                raise UsageError("--nproc-per-node gpu: no GPU is visible")
            return torch.cuda.device_count() if value == "gpu" else os.cpu_count() or 1
        try:
            value = int(value)
        except ValueError:
            raise UsageError(
                f"--nproc-per-node must be a whole number, 'auto', 'cpu' or 'gpu', not "
                f"{value!r}"
            ) from None
    return value


_AGENT_ENV = "SHOAL_AGENT_OPTIONS"  # (AgentOptions.environ)
# A live job's workers' lines: each group's ranks start from 0, as in a job of its own.
GROUP_PREFIX = "[group${replica_group} rank${rank}]: "


@dataclass(frozen=True)
class AgentOptions:
    """Settings of torch's elastic agent that torchrun's flags give and shoal passes on as
    given (shoal.cli.torchrun); each default is what shoal does without the flag."""

    role: str = "default"
    """The workers' role (ROLE_NAME), as torchrun names it."""
    event_log_handler: str | None = None
    """torch.distributed.elastic's event handler; None: torch's default (null)."""
    redirects: str = "0"
    """torchrun's ``--redirects``: streams kept out of the terminal (they are always logged,
    for the failure summary); per local rank as ``0:1,1:2``."""
    tee: str = "0"
    """torchrun's ``--tee``: streams shown as well; shoal shows all but ``redirects``'."""
    local_ranks_filter: str | None = None
    """Show only these local ranks' output (``0,2``); None: all."""
    log_line_prefix_template: str = "[rank${rank}]: "
    """The prefix of each shown line: ${rank}, ${local_rank}, ${role_name} and ${hostname}
    are substituted per worker, and ${replica_group} in live mode (whose default,
    ``GROUP_PREFIX``, names the group)."""
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    """Lines holding one of these are also copied to a file of their own (torch 2.13 on)."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it; None: found by shoal."""
    logs_specs: str | None = None
    """A LogsSpecs of the entry point group ``torchrun.logs_specs``; None: torch's default."""
    numa_binding: str | None = None
    """Bind each GPU worker near its GPU: node, socket, exclusive or core-complex."""
    signals_to_handle: str | None = None
    """Signals passed on to the workers; None: shoal's list (torchrun's and SIGUSR1)."""
    shutdown_timeout: int | None = None
    """Seconds between SIGTERM and SIGKILL when workers are stopped; None: shoal's 60."""
    virtual_local_rank: bool = False
    """Each worker sees LOCAL_RANK 0 and only its own GPU."""
    rdzv_conf: dict = field(default_factory=dict)
    """More settings of the c10d rendezvous (``--rdzv-conf``: join_timeout, ...)."""

    def for_group(self, group: int) -> AgentOptions:
        """These settings for live mode's replica group ``group``: its workers' lines name
        the group (torchrun's default prefix becomes ``GROUP_PREFIX``)."""
        template = self.log_line_prefix_template
        if template == AgentOptions.log_line_prefix_template:
            template = GROUP_PREFIX
        # (only this name: the template is substituted again for each line, "$$" and all)
        return replace(self, log_line_prefix_template=template.replace(
            "${replica_group}", str(group)))

    def environ(self) -> dict[str, str]:
        """These settings for a replica group's launcher (``from_environ``): a live job's
        groups show and stop their workers as the job's flags say."""
        return {_AGENT_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_environ(cls) -> AgentOptions | None:
        """The settings a live job's launcher handed this group's launcher (taken out of
        the environment: its workers do not get them), or None."""
        given = os.environ.pop(_AGENT_ENV, None)
        if given is None:
            return None
        fields = json.loads(given)
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            fields[name] = tuple(fields[name])
        return cls(**fields)

    def __post_init__(self) -> None:
        from torch.distributed.elastic.multiprocessing import Std

        for name in ("redirects", "tee"):
            try:
                Std.from_str(getattr(self, name))
            except ValueError:
                raise UsageError(f"--{name} takes 0, 1, 2 or 3, or per local rank 0:1,1:2; "
                                 f"got {getattr(self, name)!r}") from None
        if self.local_ranks_filter is not None:
            ranks = self.local_ranks_filter.split(",")
            if not all(rank.strip().isdigit() for rank in ranks):
                raise UsageError("--local-ranks-filter takes local ranks as 0,1,2; got "
                                 f"{self.local_ranks_filter!r}")
        if self.shutdown_timeout is not None and self.shutdown_timeout < 0:
            raise UsageError(f"--shutdown-timeout must be 0 or more, got {self.shutdown_timeout}")

    def shown_streams(self, nproc: int) -> dict[int, set[str]]:
        """The streams ("stdout", "stderr") each local rank shows on the terminal: all but
        those redirected without being teed, and none of a rank left out by
        ``local_ranks_filter``."""
        from torch.distributed.elastic.multiprocessing import Std

        def per_rank(value):
            parsed = Std.from_str(value)
            return parsed if isinstance(parsed, dict) else dict.fromkeys(range(nproc), parsed)

        redirects, tee = per_rank(self.redirects), per_rank(self.tee)
        ranks = self.ranks_shown()
        shown = {}
        for rank in range(nproc):
            hidden = redirects.get(rank, Std.NONE).value & ~tee.get(rank, Std.NONE).value
            shown[rank] = {name for name, bit in (("stdout", Std.OUT), ("stderr", Std.ERR))
                           if not hidden & bit.value and (ranks is None or rank in ranks)}
        return shown

    def ranks_shown(self) -> set[int] | None:
        """The local ranks ``local_ranks_filter`` shows; None: all."""
        if self.local_ranks_filter is None:
            return None
        return {int(rank) for rank in self.local_ranks_filter.split(",")}


OUR_ENTRIES = frozenset({"shoal.launch.train_entry", "shoal.launch.rl_entry"})
"""The worker entries of `shoal train` and `shoal rl`."""


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
    (``nproc_per_node`` each) and its own restarts (the job has ``nnodes`` times as many).
    With ``independent_copies``: this many copies of the job."""
    independent_copies: bool = False
    """Run ``replica_groups`` copies of the job that never meet, each in a working folder
    of its own (``replica-group-<g>/``), instead of live mode's groups (which only a script
    that trains through shoal.Trainer can be)."""
    fault_tolerance: FaultToleranceConfig | None = None
    """Live recovery's settings (policy, timeouts); None: restarts (the default), as
    ``mode: restart``."""
    preload: bool = True
    """Fork the workers from a server that has imported torch once (Linux), so that a
    restarted worker starts in a fraction of a second; False: each worker is a new
    ``python`` process (shoal.launch.worker_start)."""
    scheduling: Scheduling = "batch"
    """How Linux schedules the job's processes (shoal.launch.scheduling). The `shoal`
    command applies it to itself before it starts anything; a launch from Python leaves the
    calling process as it is. Given on to a live mode's group launchers."""
    no_python: bool = False
    """``entry`` is a program of its own, run without the Python bootstrap (torchrun's
    ``--no-python``)."""
    agent: AgentOptions = field(default_factory=AgentOptions)
    """torchrun's settings of the elastic agent, passed on as given."""

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
            self.rdzv_endpoint = with_port(self.rdzv_endpoint)
        elif self.min_nodes is not None and self.min_nodes < self.nnodes:
            raise UsageError("--nnodes MIN:MAX (elastic) needs c10d rendezvous: give "
                             "--rdzv-endpoint HOST:PORT and --rdzv-id JOB")
        elif self.nnodes > 1 and self.master_port is None:
            raise UsageError("--master-port is required when --nnodes is more than 1")
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise UsageError(f"--hang-timeout must be positive, got {self.hang_timeout}")
        if self.replica_groups < 1:
            raise UsageError(f"--replica-groups must be at least 1, got {self.replica_groups}")
        if self.live and (self.elastic or self.min_nodes is not None):
            raise UsageError("live mode across nodes runs one replica group per node, which "
                             "come and go by themselves: give --nnodes N with --node-rank, "
                             "--master-addr and --master-port, not --rdzv-endpoint or "
                             "--nnodes MIN:MAX")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.no_python and self.module:
            raise UsageError("--no-python runs a program, -m a Python module: give one")
        if self.no_python and not (shutil.which(self.entry) or os.path.isfile(self.entry)):
            raise UsageError(f"program not found: {self.entry}")
        if not self.module and not self.no_python and not os.path.isfile(self.entry):
            raise UsageError(f"script not found: {self.entry}")
        if self.module:
            self._check_module_importable()
        if self.independent_copies and (self.nnodes > 1 or self.live):
            raise UsageError("--independent-copies runs copies of the job on this node that "
                             "never meet: drop --nnodes and the live-mode flags")
        if self.live and not self.ours:
            self._check_trains_through_shoal()

    def _check_rdzv(self) -> None:
        host, _, port = with_port(self.rdzv_endpoint or "").rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise UsageError(f"--rdzv-endpoint must be HOST or HOST:PORT, got "
                             f"{self.rdzv_endpoint!r}")
        if int(port) == 0 and self.nnodes > 1:
            raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint}: port 0 lets this node's "
                             "system pick the store's port, which the other nodes cannot "
                             "know: give the port every node meets at")
        if not self.rdzv_id:
            raise UsageError("--rdzv-endpoint needs --rdzv-id JOB (the same on every node)")
        if self.rdzv_last_call < 0:
            raise UsageError(f"--rdzv-last-call must be 0 or more, got {self.rdzv_last_call}")

    @property
    def live(self) -> bool:
        """Live recovery: replica groups instead of restarts of every worker."""
        return self.fault_tolerance is not None and self.fault_tolerance.live

    @property
    def ours(self) -> bool:
        """The workers run shoal's own entry (`shoal train`, `shoal rl`), not a user's
        script: nothing of the user's runs before torch is imported, so the first attempt's
        workers are forked from the preloaded server too (shoal.launch.worker_start)."""
        return self.module and self.entry in OUR_ENTRIES

    @property
    def elastic(self) -> bool:
        """Node ranks come from a c10d rendezvous rather than from ``node_rank``."""
        return self.rdzv_endpoint is not None

    def _check_module_importable(self) -> None:
        from shoal.launch.entry import find_module

        if find_module(self.entry, os.getcwd()) is None:
            raise UsageError(f"module not found: {self.entry}")

    def _check_trains_through_shoal(self) -> None:
        """Live mode's groups meet only in shoal's Trainer: a script that sets up
        torch.distributed itself would run as that many copies writing the same files."""
        from shoal.launch.entry import trains_through_shoal

        what = f"{'module' if self.module else 'script'} {self.entry}"
        if self.no_python or not trains_through_shoal(self.entry, self.module, os.getcwd()):
            raise UsageError(
                f"live mode: the {what} does not train through shoal.Trainer (no use of "
                "it found in it or the modules of yours it imports), and only the Trainer "
                "meets the other replica groups: each group would be a copy of the job "
                "writing the same files. Train through "
                "shoal.Trainer, run without --replica-groups, or add --independent-copies "
                "for copies that each run in a folder of their own")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node
