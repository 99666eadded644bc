"""`shoal run`: launch a script or module on several processes, as torchrun would."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, cast

from shoal.cli.torchrun import (
    add_script_arguments,
    add_torchrun_arguments,
    agent_options,
    apply_torchrun_rendezvous,
    flag,
    pet_defaults,
)
from shoal.clusters.detect import ClusterEnv, detect
from shoal.errors import UsageError
from shoal.launch import LaunchSpec, launch
from shoal.launch.config import resolve_nproc
from shoal.launch.forkserver import fork_server_now
from shoal.launch.scheduling import SCHEDULINGS

if TYPE_CHECKING:
    from typing import TypedDict

    from shoal.ft import FaultToleranceConfig

    class _NodeCounts(TypedDict):
        nnodes: int
        min_nodes: int | None


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The topology flags shared by `shoal run` and `shoal train`, and the rest of
    torchrun's (shoal.cli.torchrun)."""
    # Topology flags default to None, "not given": then the values of a scheduler found in
    # the environment (SLURM, MPI, Kubernetes; see shoal.clusters.detect) apply, if any.
    flag(parser, "--nproc-per-node", default=None,
                        help="worker processes on this node: a number or 'auto' "
                        "(default: the scheduler's, else 1)")
    flag(parser, "--nnodes", default=None, metavar="N|MIN:MAX",
                        help="number of nodes (default: the scheduler's, else 1); MIN:MAX is "
                        "elastic: the job goes on with as few as MIN nodes (needs "
                        "--rdzv-endpoint)")
    flag(parser, "--node-rank", type=int, default=None,
                        help="this node's rank (default: the scheduler's, else 0)")
    flag(parser, "--master-addr", default=None,
                        help="address of node 0 (default: the scheduler's, else 127.0.0.1)")
    flag(parser, "--master-port", type=int, default=None,
                        help="port on node 0 (default: the scheduler's; on one node a free "
                        "port is picked)")
    flag(parser, "--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="c10d rendezvous store: node ranks are assigned when nodes meet "
                        "(instead of --node-rank/--master-addr/--master-port)")
    flag(parser, "--rdzv-id", default=None, metavar="JOB",
                        help="the job's name at the rendezvous, the same on every node")
    flag(parser, "--rdzv-host", action="store_true",
                        help="this node hosts the rendezvous store (default: the node that "
                        "owns the endpoint's address)")
    flag(parser, "--rdzv-last-call", type=float, default=10.0, metavar="SECONDS",
                        help="once MIN nodes are there, wait this long for more (default 10)")
    flag(parser, "--max-restarts", type=int, default=None,
                        help="restart all workers up to K times after a failure (default 0)")
    flag(parser, "--log-dir", default=None, help="keep one log per rank in DIR")
    flag(parser, "--hang-timeout", type=float, default=None, metavar="SECONDS",
                        help="report where every rank is and stop the job when no rank made "
                        "progress for this long (default 600; in live mode half the "
                        "replacement timeout; 0 turns it off)")
    flag(parser, "--debug", action="store_true",
                        help="check each collective across ranks (op, shapes, dtypes)")
    flag(parser, "--ft-mode", choices=["restart", "live"], default=None,
                        help="how the job lives through a failure: 'restart' (default) "
                        "restarts every worker from the last checkpoint; 'live' runs it as "
                        "replica groups, one per node (docs/fault_tolerance.md)")
    flag(parser, "--replica-groups", type=int, default=None, metavar="R",
                        help="live recovery: run R replica groups on this node, each with its "
                        "own workers and restarts; a failed group heals from a live one while "
                        "the others wait or go on (implies --ft-mode live)")
    flag(parser, "--independent-copies", action="store_true",
                        help="with --replica-groups R, for a script that does not train "
                        "through shoal.Trainer: run R copies of the job that never meet "
                        "(no live recovery), each in a working folder of its own, "
                        "replica-group-<g>/")
    flag(parser, "--ft-policy", choices=["exact", "available"], default=None,
                        help="live mode: 'exact' (default) waits for the replacement and "
                        "ends bitwise equal to a run without failures; 'available' goes on "
                        "without the missing group")
    flag(parser, "--lighthouse", default=None, metavar="http://HOST:PORT",
                        help="live mode: a running torchft lighthouse (default: one is "
                        "started for the job)")
    flag(parser, "--ft-step-timeout", type=float, default=None, metavar="SECONDS",
                        help="live mode: the longest a step across groups may wait for one "
                        "(fault_tolerance.step_timeout_s, default 10)")
    flag(parser, "--ft-replacement-timeout", type=float, default=None,
                        metavar="SECONDS",
                        help="live mode, policy exact: how long the other groups wait for a "
                        "replacement (fault_tolerance.replacement_timeout_s, default 120)")
    flag(parser, "--no-preload", dest="preload", action="store_false",
                        help="start each worker as a new python process instead of forking "
                        "it from a server that has imported torch (Linux; restarts are "
                        "slower then)")
    flag(parser, "--scheduling", choices=SCHEDULINGS, default="batch",
                        help="how Linux schedules the job's processes: 'batch' (default; "
                        "SCHED_BATCH: a waking thread does not take the core from a working "
                        "one) or 'normal' (as started)")
    flag(parser, "--torchrun-exit-codes", action="store_true",
                        help="exit as torchrun does: 0 when every rank succeeded, else 1 "
                        "(default: the status of the rank that failed first, 137 for a "
                        "SIGKILL)")
    add_torchrun_arguments(parser)
    pet_defaults(parser)


def add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """`--fetch-data URL DEST`: the node fetches its data before its workers start."""
    flag(parser, "--fetch-data", nargs=2, default=None, metavar=("URL", "DEST"),
                        help="first fetch the dataset `shoal data serve` serves at URL into "
                        "DEST on this node (see `shoal data fetch`)")
    flag(parser, "--fetch-token-file", default=None, metavar="FILE",
                        help="the data server's token, for --fetch-data")


def fetch_first(args: argparse.Namespace, cluster: ClusterEnv | None) -> int:
    """Run the fetch ``--fetch-data`` asks for (if any); its exit status, 0 when done."""
    if not args.fetch_data:
        return 0
    if cluster is not None and cluster.per_process:
        raise UsageError(f"--fetch-data: {cluster.label} started every worker, so each "
                         "would fetch; run `shoal data fetch` once per node before them")
    from shoal.data.fetch import fetch_command

    # (mypy cannot know that the list holds two items, URL and DEST, not three)
    return fetch_command(*args.fetch_data, token_file=args.fetch_token_file)  # type: ignore[misc]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a script on several processes",
        description="Launch SCRIPT (or -m MODULE) on several worker processes with the "
        "environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...).",
    )
    add_launch_arguments(parser)
    parser.add_argument("-m", "--module", dest="module", action="store_true",
                        help="treat ENTRY as a module name, like python -m")
    add_script_arguments(parser)
    add_fetch_arguments(parser)
    parser.add_argument("entry", metavar="SCRIPT|MODULE", help="the training script or module")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    pet_defaults(parser)
    parser.set_defaults(handler=run_command)


def _node_counts(value: str) -> _NodeCounts:
    """``--nnodes N`` or ``MIN:MAX`` as LaunchSpec fields."""
    low, sep, high = str(value).partition(":")
    try:
        counts = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise UsageError(f"--nnodes must be N or MIN:MAX, got {value!r}") from None
    return {"nnodes": counts[1], "min_nodes": counts[0] if sep else None}


def detect_cluster(args: argparse.Namespace) -> ClusterEnv | None:
    """The scheduler's description of this job (SLURM, MPI, Kubernetes, torchrun), or None.

    Flags win: with all four of --nnodes, --node-rank, --master-addr and --master-port
    nothing is detected; --master-addr and --master-port take the place of MASTER_ADDR and
    MASTER_PORT. Where the scheduler started every worker itself, the flags that size a node
    of workers are refused, since shoal starts none.
    """
    if args.rdzv_endpoint is not None or None not in (
            args.nnodes, args.node_rank, args.master_addr, args.master_port):
        return None
    environ = dict(os.environ)
    if args.master_addr is not None:
        environ["MASTER_ADDR"] = args.master_addr
    if args.master_port is not None:
        environ["MASTER_PORT"] = str(args.master_port)
    cluster = detect(environ)
    if cluster is not None and cluster.per_process:
        for flag, value in (("--nproc-per-node", args.nproc_per_node),
                            ("--nnodes", args.nnodes), ("--node-rank", args.node_rank)):
            if value is not None:
                raise UsageError(
                    f"{flag}: {cluster.label} started every worker process itself "
                    f"({cluster.world_size} in all, this one rank {cluster.rank}), so shoal "
                    f"starts none; drop {flag}, or start one task per node "
                    "(srun --ntasks-per-node=1) for shoal to start the workers")
    return cluster


def _given(*values):
    """The first value that is not None: a flag, then the scheduler's, then the default."""
    return next(value for value in values if value is not None)


_LIVE_FLAGS = ("ft_mode", "replica_groups", "ft_policy", "lighthouse", "ft_step_timeout",
               "ft_replacement_timeout")


def live_settings(args: argparse.Namespace, base: FaultToleranceConfig | None = None,
                  nnodes: int = 1) -> FaultToleranceConfig | None:
    """The run's fault tolerance: a config's ``fault_tolerance`` section, overridden by the
    live-mode flags (``--ft-mode`` or ``--replica-groups`` chooses live mode); None where
    neither says anything (restarts, without loading live mode's settings)."""
    if base is None and all(getattr(args, name) is None for name in _LIVE_FLAGS):
        return None
    from shoal.ft import FaultToleranceConfig

    base = base or FaultToleranceConfig()
    update: dict = {}
    if args.ft_mode == "restart" and args.replica_groups is not None:
        raise UsageError("--replica-groups runs live mode: drop --ft-mode restart")
    if args.ft_mode is not None:
        update["mode"] = args.ft_mode
    if args.replica_groups is not None:
        update.update(mode="live", replica_groups=args.replica_groups)
    if args.ft_policy is not None:
        update["policy"] = args.ft_policy
    if args.lighthouse is not None:
        update["lighthouse"] = args.lighthouse
    timeouts = {"step_timeout_s": args.ft_step_timeout,
                "replacement_timeout_s": args.ft_replacement_timeout}
    update.update({key: value for key, value in timeouts.items() if value is not None})
    config = FaultToleranceConfig.build(**{**base.model_dump(), **update})
    if not config.live and (args.ft_policy or args.lighthouse
                            or any(value is not None for value in timeouts.values())):
        raise UsageError("--ft-policy, --lighthouse and --ft-*-timeout are settings of live "
                         "mode: add --ft-mode live (one replica group per node) or "
                         "--replica-groups R")
    if config.live and (config.replica_groups or 1) * nnodes < 2:
        raise UsageError("live mode needs at least 2 replica groups: run on 2 or more nodes "
                         "(--nnodes N, one group per node) or give --replica-groups R (or "
                         "fault_tolerance.replica_groups) of 2 or more")
    return config


def spec_from_args(args: argparse.Namespace, entry: str, script_args: list[str],
                   module: bool, nproc_default: int | str = 1,
                   cluster: ClusterEnv | None = None,
                   fault_tolerance: FaultToleranceConfig | None = None) -> LaunchSpec:
    """Build the LaunchSpec from parsed flags, then a per-node ``cluster``'s values, then the
    defaults; validation happens in LaunchSpec itself."""
    apply_torchrun_rendezvous(args)
    node = cluster if cluster is not None and not cluster.per_process else None
    # (a scheduler's ClusterEnv of one task per node always has nnodes)
    counts: _NodeCounts = (_node_counts(args.nnodes) if args.nnodes is not None
                           else {"nnodes": cast(int, node.nnodes) if node else 1,
                                 "min_nodes": None})
    copies = getattr(args, "independent_copies", False)
    if copies:
        if args.replica_groups is None:
            raise UsageError("--independent-copies needs --replica-groups R, the number of "
                             "copies")
        if any(getattr(args, name) is not None for name in _LIVE_FLAGS[2:]) or \
                args.ft_mode == "live":
            raise UsageError("--independent-copies runs copies that never meet: drop "
                             "--ft-mode, --ft-policy, --lighthouse and --ft-*-timeout")
        live = None
    else:
        live = live_settings(args, fault_tolerance, counts["nnodes"] or 1)
    return LaunchSpec(
        entry=entry,
        args=script_args,
        module=module,
        nproc_per_node=resolve_nproc(_given(args.nproc_per_node,
                                            node and node.nproc_per_node, nproc_default)),
        **counts,
        node_rank=_given(args.node_rank, node and node.node_rank, 0),
        master_addr=_given(args.master_addr, node and node.master_addr, "127.0.0.1"),
        master_port=args.master_port if args.master_port is not None or node is None
        else node.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_host=args.rdzv_host,
        rdzv_last_call=args.rdzv_last_call,
        max_restarts=args.max_restarts or 0,
        monitor_interval=_given(args.monitor_interval, 0.1),
        log_dir=args.log_dir,
        hang_timeout=_given(args.hang_timeout,
                            live.default_hang_timeout_s if live and live.live else 600.0)
        or None,
        debug=args.debug,
        replica_groups=args.replica_groups if copies
        else live.replica_groups or 1 if live and live.live else 1,
        independent_copies=copies,
        fault_tolerance=live,
        preload=args.preload,
        scheduling=args.scheduling,
        no_python=getattr(args, "no_python", False),
        agent=agent_options(args),
    )


def announce(spec: LaunchSpec, cluster: ClusterEnv | None) -> None:
    """One line on stderr, from node 0 (or rank 0), about what the scheduler said."""
    if cluster is None:
        return
    def count(n: int | None, noun: str) -> str:
        return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"

    if cluster.per_process:
        if cluster.rank == 0:
            nodes = (f" ({count(cluster.nnodes, 'node')} x {cluster.local_world_size})"
                     if cluster.nnodes else "")
            sys.stderr.write(f"shoal: {cluster.label}: {count(cluster.world_size, 'process')}"
                             f"{nodes} started by the scheduler, master {cluster.master_addr}:"
                             f"{cluster.master_port}\n")
    elif spec.node_rank == 0:
        sys.stderr.write(f"shoal: {cluster.label}: {count(spec.nnodes, 'node')} x "
                         f"{count(spec.nproc_per_node, 'process')}, master "
                         f"{spec.master_addr}:{spec.master_port}\n")


def start(spec: LaunchSpec, cluster: ClusterEnv | None) -> int:
    """Launch the workers; where the scheduler started every worker, become this one."""
    announce(spec, cluster)
    if cluster is not None and cluster.per_process:
        from shoal.launch.direct import run_in_place

        run_in_place(spec, cluster)
    return launch(spec)


def fork_server_ahead(args: argparse.Namespace) -> None:
    """Fork the workers' server from this process now, before anything of the user's is
    imported here (a config's modules): it has imported torch, so the server need not
    (shoal.launch.forkserver.fork_server_now). Only for the `shoal` command itself (a
    process that called ``main`` may run anything), and not for a job that starts no worker
    from it: ``--no-preload``, ``--no-python``, or live mode's launcher of launchers."""
    if getattr(args, "preload", False) and not getattr(args, "no_python", False) and \
            getattr(args, "replica_groups", None) is None:
        fork_server_now()


def run_command(args: argparse.Namespace) -> int:
    cluster = detect_cluster(args)
    spec = spec_from_args(args, args.entry, args.args, args.module, cluster=cluster)
    return fetch_first(args, cluster) or start(spec, cluster)
