"""`shoal run`: start workers with torch.distributed.elastic and report how they ended."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shoal.errors import UsageError
from shoal.launch.config import AgentOptions, LaunchSpec
from shoal.launch.forked import cancel_server_start, first_attempt_as
from shoal.launch.forkserver import drop_server
from shoal.launch.hangwatch import HangWatch
from shoal.launch.network import choose_interface
from shoal.launch.nodes import NodeWatch
from shoal.launch.output import OutputRelay, shoal_says
from shoal.launch.ports import check_port_free, free_port
from shoal.launch.restarts import RestartLog
from shoal.launch.summary import report_failure
from shoal.launch.worker_start import WorkerStart, worker_start
from shoal.runtime.compat import (
    cheap_rendezvous_event_names,
    has_shutdown_grace,
    launch_config_fields,
    rendezvous_join_delay,
    worker_store_port,
)
from shoal.runtime.parent import LAUNCHER_ENV

SHUTDOWN_TIMEOUT_S = 60
HANG_EXIT_CODE = 124  # as timeout(1)
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def _is_local(addr: str) -> bool:
    import socket

    import psutil

    if addr in _LOCAL_HOSTS:
        return True
    if addr in {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
                for a in addrs}:
        return True
    try:
        return addr in {socket.gethostname(), socket.getfqdn()} or addr in {
            info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)
        }
    except OSError:
        return False


def _listening(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _hosts_store(spec: LaunchSpec) -> bool:
    """Whether this node starts the c10d store: told so, or the endpoint is one of its own
    addresses and no store listens there yet (a second node on the same machine joins it)."""
    if spec.rdzv_host:
        return True
    host, port = store_address(spec)
    return host not in _LOCAL_HOSTS and _is_local(host) and not _listening(host, port)


def store_address(spec: LaunchSpec) -> tuple[str, int]:
    """Where the job's rendezvous store listens: the c10d endpoint, or the master."""
    if spec.rdzv_endpoint:
        host, _, port = spec.rdzv_endpoint.rpartition(":")
        return host, int(port)
    return spec.master_addr, spec.master_port or 0


def fresh_store_per_attempt(needed: bool) -> None:
    """Whether each attempt's rank 0 hosts a new store for the workers' process group.

    With c10d rendezvous the workers otherwise share the agent's store across rounds, and
    a restarted group reads the previous attempt's gloo addresses: it connects to dead
    workers and hangs in init_process_group. A new store has a race of its own: the agent
    picks a free port that worker 0 binds seconds later, and another program may take it
    in between (EADDRINUSE). So it is used only where a second round can happen, on a port
    drawn where other programs' ports do not come from (``shoal.launch.ports.free_port``).
    """
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1" if needed else "0"
    if needed:
        worker_store_port(free_port)


def second_round_possible(spec: LaunchSpec) -> bool:
    """Restarts, or a node count that may change, start the workers again."""
    return spec.max_restarts > 0 or (spec.min_nodes or spec.nnodes) != spec.nnodes


def build_launch_config(spec: LaunchSpec, log_dir: str, address: str | None = None,
                        start: WorkerStart | None = None) -> LaunchConfig:
    """Map the validated spec onto torch's own LaunchConfig.

    ``address``: this node's address as the other nodes reach it (multi-node). The node
    that gets rank 0 tells the workers of every node to meet there (MASTER_ADDR).
    ``start``: how the workers start (shoal.launch.worker_start)."""
    if spec.rdzv_endpoint:
        assert spec.rdzv_id is not None  # LaunchSpec requires it with an endpoint
        rdzv_backend, endpoint, run_id = "c10d", spec.rdzv_endpoint, spec.rdzv_id
        rdzv_configs = {"last_call_timeout": spec.rdzv_last_call}
        host, _ = store_address(spec)
        if host not in _LOCAL_HOSTS:  # torch guesses from the hostname, which may not resolve
            rdzv_configs["is_host"] = _hosts_store(spec)
    elif spec.nnodes == 1 and spec.master_port is None:
        # The c10d store binds port 0, so the OS picks a free port: no "address in use" race.
        rdzv_backend, endpoint, rdzv_configs = "c10d", "127.0.0.1:0", {}
        run_id = f"shoal-{uuid.uuid4().hex[:8]}"
    else:
        rdzv_backend = "static"
        endpoint = f"{spec.master_addr}:{spec.master_port}"
        rdzv_configs = {"rank": spec.node_rank}
        # Every node must name the same run, and each derives it from the same flags.
        run_id = f"shoal-{spec.master_addr}-{spec.master_port}"
    agent = spec.agent
    if spec.rdzv_endpoint or rdzv_backend == "c10d":
        rdzv_configs = {**agent.rdzv_conf, **rdzv_configs}
    # Settings only some torch releases have (shoal.runtime.compat), each given only when
    # asked for; before torch 2.12 the grace period before SIGKILL is torch's fixed 30 s.
    optional: dict[str, Any] = {"shutdown_timeout": (agent.shutdown_timeout
                                                     if agent.shutdown_timeout is not None
                                                     else SHUTDOWN_TIMEOUT_S)}
    if agent.event_log_handler is not None:
        optional["event_log_handler"] = agent.event_log_handler
    if agent.duplicate_stdout_filters:
        optional["duplicate_stdout_filters"] = list(agent.duplicate_stdout_filters)
    if agent.duplicate_stderr_filters:
        optional["duplicate_stderr_filters"] = list(agent.duplicate_stderr_filters)
    if agent.virtual_local_rank:
        optional["virtual_local_rank"] = True
    if agent.numa_binding is not None:
        optional["numa_options"] = numa_options(agent.numa_binding)
    missing = sorted(set(optional) - launch_config_fields() - {"shutdown_timeout"})
    if missing:
        raise UsageError(f"this torch's launcher has no {', '.join(missing)}: drop "
                         f"--{missing[0].replace('_', '-').replace('-options', '-binding')}")
    if not has_shutdown_grace():
        if agent.shutdown_timeout is not None:
            raise UsageError("--shutdown-timeout: this torch's launcher waits its fixed 30 s")
        del optional["shutdown_timeout"]
    return LaunchConfig(
        min_nodes=spec.min_nodes or spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=run_id,
        role=agent.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=spec.monitor_interval,
        start_method=(start or worker_start(spec)).start_method,
        logs_specs=logs_specs(agent, log_dir, spec.nproc_per_node),
        log_line_prefix_template=agent.log_line_prefix_template,
        # SIGUSR1 too (SLURM's warning before the end): the agent passes the signal on to
        # the workers, and gives them time to save a checkpoint before SIGKILL.
        signals_to_handle=agent.signals_to_handle or "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        local_addr=agent.local_addr or address or (spec.master_addr if spec.nnodes == 1
                                                   else None),
        **optional,
    )


def numa_options(binding: str):
    """torch's NUMA binding for ``--numa-binding``."""
    from torch.numa.binding import AffinityMode, NumaOptions

    return NumaOptions(affinity_mode=AffinityMode(binding))


def logs_specs(agent: AgentOptions, log_dir: str, nproc: int) -> LogsSpecs:
    """Where each rank's output goes: always to its log files (the failure summary reads
    them), and to the terminal unless ``--redirects`` keeps it out; a ``--logs-specs``
    plugin of the entry point group torchrun.logs_specs in place of torch's default."""
    if agent.logs_specs is not None:
        from importlib import metadata

        found = metadata.entry_points(group="torchrun.logs_specs").select(
            name=agent.logs_specs)
        if not found:
            raise UsageError(f"--logs-specs {agent.logs_specs}: no such entry point in the "
                             "group torchrun.logs_specs of the installed packages")
        cls: type[LogsSpecs] = next(iter(found)).load()
        # Teed back to the terminal: what torchrun would show of each rank.
        tee = {rank: (Std.OUT if "stdout" in shown else Std.NONE)
               | (Std.ERR if "stderr" in shown else Std.NONE)
               for rank, shown in agent.shown_streams(nproc).items()}
        return cls(log_dir=log_dir, redirects=Std.ALL, tee=tee,
                   local_ranks_filter=agent.ranks_shown())
    # Shown by shoal's OutputRelay, which keeps each rank's lines in the order written.
    return DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.NONE)


def start_output_relay(spec: LaunchSpec, log_dir: str) -> OutputRelay | None:
    """Show the ranks' output, unless a --logs-specs plugin decides where it goes (torch's
    agent shows it then)."""
    if spec.agent.logs_specs is not None:
        return None
    streams = spec.agent.shown_streams(spec.nproc_per_node)
    relay = OutputRelay(log_dir, streams.get, first_rank=spec.node_rank * spec.nproc_per_node,
                        template=spec.agent.log_line_prefix_template, role=spec.agent.role)
    relay.start()
    return relay


def _new_log_dir(parent: str | None) -> str:
    if parent is None:
        return tempfile.mkdtemp(prefix="shoal-logs-")
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix="run-", dir=parent)
    except OSError as exc:
        raise UsageError(f"--log-dir {parent}: {exc.strerror}") from None


def _start_hang_watch(spec: LaunchSpec, log_dir: str, nodes: NodeWatch | None
                      ) -> HangWatch | None:
    if spec.hang_timeout is None:
        return None
    directory = os.path.join(log_dir, "heartbeats")
    os.makedirs(directory, exist_ok=True)
    os.environ["SHOAL_HEARTBEAT_DIR"] = directory  # the workers inherit it
    watch = HangWatch(directory, spec.nproc_per_node, spec.hang_timeout,
                      network=nodes.silent if nodes else None)
    watch.start()
    return watch


def _start_node_watch(spec: LaunchSpec) -> NodeWatch | None:
    """Multi-node: choose the interface that reaches the store, and beat there."""
    if spec.nnodes == 1:
        return None
    host, port = store_address(spec)
    _, address = choose_interface(host, "this node" if spec.elastic
                                  else f"node {spec.node_rank}")
    watch = NodeWatch(host, port, address)
    watch.start()
    return watch


def _shown_torch_level() -> int:
    """The level of torch's launcher logs that is printed (SHOAL_TORCH_LOG_LEVEL)."""
    level = logging.getLevelName(os.environ.get("SHOAL_TORCH_LOG_LEVEL", "CRITICAL").upper())
    return level if isinstance(level, int) else logging.CRITICAL


def quiet_torch_logs() -> None:
    # The agent logs every state change; shoal prints its own summary instead.
    # torch gives each of its modules a logger with its own level, so set them one by one.
    level = _shown_torch_level()
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher",
                            "torch.multiprocessing")):
            logging.getLogger(name).setLevel(level)


def launch(spec: LaunchSpec) -> int:
    """Run the job described by ``spec``; return the launcher's exit code."""
    # Several processes on one node (a live job's groups too) would otherwise each start a
    # thread per core.
    local = spec.nproc_per_node * (spec.replica_groups
                                   if spec.live or spec.independent_copies else 1)
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
    if spec.independent_copies:
        from shoal.launch.groups import launch_copies

        drop_server()  # each copy's launcher forks its own
        return launch_copies(spec)
    if spec.live:
        drop_server()  # each replica group's launcher forks its own
    if spec.live and spec.nnodes > 1:
        from shoal.launch.live_nodes import launch_live_nodes

        return launch_live_nodes(spec)
    if spec.live:
        from shoal.launch.groups import launch_groups

        return launch_groups(spec)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers' parent (see die_with_parent)
    if spec.master_port is not None and spec.node_rank == 0 and _is_local(spec.master_addr):
        host = spec.master_addr if spec.master_addr != "localhost" else "127.0.0.1"
        check_port_free(host, spec.master_port)
    if spec.debug:
        # torch checks every collective's fingerprint across ranks and names a mismatch.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    nodes = _start_node_watch(spec)
    quiet_torch_logs()
    fresh_store_per_attempt(second_round_possible(spec))
    cheap_rendezvous_event_names()
    rendezvous_join_delay(spec.nnodes > 1 or spec.elastic)
    # A folder of its own for every launch, also inside a reused --log-dir, so that the
    # failure summary never reads an older job's error files.
    log_dir = _new_log_dir(spec.log_dir)
    watch = _start_hang_watch(spec, log_dir, nodes)
    relay = start_output_relay(spec, log_dir)
    restarts = RestartLog(log_dir, spec.max_restarts,
                          spec.node_rank * spec.nproc_per_node).install()
    # Last, once every variable for the workers is set: forked workers get this environment.
    start = worker_start(spec)
    config = build_launch_config(spec, log_dir, nodes.address if nodes else None, start)
    if start.first is not None:
        first_attempt_as(start.first, again=second_round_possible(spec))
    try:
        try:
            elastic_launch(config, start.entrypoint)(*start.args)
        finally:
            if relay is not None:
                relay.stop()  # every line shown before what the launcher says of the end
    except SignalException as exc:
        sys.stderr.write(f"{shoal_says()}stopped by {signal.Signals(exc.sigval).name}: the signal "
                         "went on to the workers (a Trainer with a checkpoint_dir saves "
                         f"first). Per-rank logs: {log_dir}\n")
        return 128 + exc.sigval
    except ChildFailedError as failed:
        if watch is not None and watch.report is not None:
            # The report itself was printed when the hang was found.
            sys.stderr.write(f"{shoal_says()}the job was stopped by the hang watch "
                             f"(--hang-timeout). Every rank's stack: "
                             f"{log_dir}/heartbeats/rank*.stack; per-rank logs: {log_dir}\n")
            return HANG_EXIT_CODE
        # The logs stay: the summary points to them.
        return report_failure(failed, log_dir, first_rank=spec.node_rank * spec.nproc_per_node,
                              nodes=nodes.known() if nodes else (), earlier=restarts.attempts)
    finally:
        cancel_server_start()
        restarts.uninstall()
        for thread in (watch, nodes):
            if thread is not None:
                thread.stop()
    if spec.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)  # output was shown; nothing to keep
    return 0
