"""`shoal run`: launch a script or module on several processes, as torchrun would."""

from __future__ import annotations

import argparse

from shoal.launch import LaunchSpec, launch
from shoal.launch.config import resolve_nproc


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The topology flags shared by `shoal run` and `shoal train`."""
    parser.add_argument("--nproc-per-node", default=None,
                        help="worker processes on this node: a number or 'auto' (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address of node 0 (default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port on node 0; on one node a free port is picked if omitted")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart all workers up to K times after a failure (default 0)")
    parser.add_argument("--log-dir", default=None, help="keep one log per rank in DIR")
    parser.add_argument("--hang-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="report where every rank is and stop the job when no rank made "
                        "progress for this long (default 600; 0 turns it off)")
    parser.add_argument("--debug", action="store_true",
                        help="check each collective across ranks (op, shapes, dtypes)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a script on several processes",
        description="Launch SCRIPT (or -m MODULE) on several worker processes with the "
        "environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...).",
    )
    add_launch_arguments(parser)
    parser.add_argument("-m", dest="module", action="store_true",
                        help="treat ENTRY as a module name, like python -m")
    parser.add_argument("entry", metavar="SCRIPT|MODULE", help="the training script or module")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run_command)


def spec_from_args(args: argparse.Namespace, entry: str, script_args: list[str],
                   module: bool, nproc_default: int | str = 1) -> LaunchSpec:
    """Build the LaunchSpec from parsed flags; validation happens in LaunchSpec itself."""
    nproc = args.nproc_per_node if args.nproc_per_node is not None else nproc_default
    return LaunchSpec(
        entry=entry,
        args=script_args,
        module=module,
        nproc_per_node=resolve_nproc(nproc),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        hang_timeout=args.hang_timeout or None,
        debug=args.debug,
    )


def run_command(args: argparse.Namespace) -> int:
    spec = spec_from_args(args, args.entry, args.args, args.module)
    return launch(spec)
