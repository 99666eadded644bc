"""`shoal run`: start workers with torch.distributed.elastic and report how they ended."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shoal.errors import UsageError
from shoal.launch.config import LaunchSpec
from shoal.launch.hangwatch import HangWatch
from shoal.launch.network import choose_interface
from shoal.launch.ports import check_port_free
from shoal.launch.summary import report_failure

SHUTDOWN_TIMEOUT_S = 60
HANG_EXIT_CODE = 124  # as timeout(1)
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def _is_local(addr: str) -> bool:
    import socket

    if addr in _LOCAL_HOSTS:
        return True
    try:
        return addr in {socket.gethostname(), socket.getfqdn()} or addr in {
            info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)
        }
    except OSError:
        return False


def fresh_store_per_attempt() -> None:
    """Let each attempt's rank 0 host a new store for the workers' process group.

    With c10d rendezvous the workers otherwise share the agent's store across restarts, and
    a restarted group reads the previous attempt's gloo addresses: it connects to dead
    workers and hangs in init_process_group.
    """
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def build_launch_config(spec: LaunchSpec, log_dir: str) -> LaunchConfig:
    """Map the validated spec onto torch's own LaunchConfig."""
    if spec.nnodes == 1 and spec.master_port is None:
        # The c10d store binds port 0, so the OS picks a free port: no "address in use" race.
        rdzv_backend, endpoint, rdzv_configs = "c10d", "127.0.0.1:0", {}
        run_id = f"shoal-{uuid.uuid4().hex[:8]}"
    else:
        rdzv_backend = "static"
        endpoint = f"{spec.master_addr}:{spec.master_port}"
        rdzv_configs = {"rank": spec.node_rank}
        # Every node must name the same run, and each derives it from the same flags.
        run_id = f"shoal-{spec.master_addr}-{spec.master_port}"
    return LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=run_id,
        role="worker",
        rdzv_endpoint=endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=spec.monitor_interval,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]: ",
        # SIGUSR1 too (SLURM's warning before the end): the agent passes the signal on to
        # the workers, and gives them time to save a checkpoint before SIGKILL.
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        local_addr=spec.master_addr if spec.nnodes == 1 else None,
    )


def _new_log_dir(parent: str | None) -> str:
    if parent is None:
        return tempfile.mkdtemp(prefix="shoal-logs-")
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix="run-", dir=parent)
    except OSError as exc:
        raise UsageError(f"--log-dir {parent}: {exc.strerror}") from None


def _start_hang_watch(spec: LaunchSpec, log_dir: str) -> HangWatch | None:
    if spec.hang_timeout is None:
        return None
    directory = os.path.join(log_dir, "heartbeats")
    os.makedirs(directory, exist_ok=True)
    os.environ["SHOAL_HEARTBEAT_DIR"] = directory  # the workers inherit it
    first = spec.node_rank * spec.nproc_per_node
    watch = HangWatch(directory, range(first, first + spec.nproc_per_node), spec.hang_timeout)
    watch.start()
    return watch


def _worker_argv(spec: LaunchSpec) -> list[str]:
    argv = ["-m", "shoal.launch.worker"]
    if spec.module:
        argv.append("-m")
    return [*argv, spec.entry, *spec.args]


def quiet_torch_logs() -> None:
    # The agent logs every state change; shoal prints its own summary instead.
    # torch gives each of its modules a logger with its own level, so set them one by one.
    level = os.environ.get("SHOAL_TORCH_LOG_LEVEL", "CRITICAL")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher",
                            "torch.multiprocessing")):
            logging.getLogger(name).setLevel(level)


def launch(spec: LaunchSpec) -> int:
    """Run the job described by ``spec``; return the launcher's exit code."""
    if spec.master_port is not None and spec.node_rank == 0 and _is_local(spec.master_addr):
        host = spec.master_addr if spec.master_addr != "localhost" else "127.0.0.1"
        check_port_free(host, spec.master_port)
    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Several processes on one node would otherwise each start a thread per core.
        os.environ["OMP_NUM_THREADS"] = "1"
    if spec.nnodes > 1:
        choose_interface(spec.master_addr, spec.node_rank)
    quiet_torch_logs()
    fresh_store_per_attempt()
    # A folder of its own for every launch, also inside a reused --log-dir, so that the
    # failure summary never reads an older job's error files.
    log_dir = _new_log_dir(spec.log_dir)
    config = build_launch_config(spec, log_dir)
    if spec.debug:
        # torch checks every collective's fingerprint across ranks and names a mismatch.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    watch = _start_hang_watch(spec, log_dir)
    try:
        elastic_launch(config, sys.executable)(*_worker_argv(spec))
    except SignalException as exc:
        sys.stderr.write(f"shoal: stopped by {signal.Signals(exc.sigval).name}: the signal "
                         "went on to the workers (a Trainer with a checkpoint_dir saves "
                         f"first). Per-rank logs: {log_dir}\n")
        return 128 + exc.sigval
    except ChildFailedError as failed:
        if watch is not None and watch.report is not None:
            # The report itself was printed when the hang was found.
            sys.stderr.write("shoal: the job was stopped by the hang watch (--hang-timeout). "
                             f"Every rank's stack: {log_dir}/heartbeats/rank*.stack; "
                             f"per-rank logs: {log_dir}\n")
            return HANG_EXIT_CODE
        # The logs stay: the summary points to them.
        return report_failure(failed, log_dir, first_rank=spec.node_rank * spec.nproc_per_node)
    finally:
        if watch is not None:
            watch.stop()
    if spec.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)  # output was shown; nothing to keep
    return 0
