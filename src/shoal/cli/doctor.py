"""`shoal doctor`: a pre-flight check of every node, run once on each before a job."""

from __future__ import annotations

import argparse

from shoal.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check the nodes before a job: network, ports, versions, bandwidth",
        description="Run once on every node with the topology flags of 'shoal run'. Checks "
        "the route to the master, the master's port, that every node reports in, that "
        "versions match node 0, and all-reduce bandwidth across the nodes; node 0 prints "
        "one verdict that every node prints too. Exit 0 when every check passed, 1 if not. "
        "Without flags: this machine alone.")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address of node 0 (default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port on node 0; on one node a free port is picked if omitted")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                        help="longest wait for the master, for every node to report, and "
                        "for the all-reduce (default 30)")
    parser.add_argument("--size", default="64M",
                        help="bytes per all-reduce in the bandwidth check (default 64M)")
    parser.set_defaults(handler=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    from shoal.bench.allreduce import parse_size
    from shoal.doctor.checks import DoctorConfig, run_doctor

    try:
        size = parse_size(args.size)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"--size: {exc}") from None
    config = DoctorConfig(nnodes=args.nnodes, node_rank=args.node_rank,
                          master_addr=args.master_addr, master_port=args.master_port,
                          timeout=args.timeout, size=size)
    return run_doctor(config)
