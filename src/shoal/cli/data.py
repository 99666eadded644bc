"""`shoal data replicate`: copy a dataset from node 0 to every node of a job."""

from __future__ import annotations

import argparse
import os
import sys

from shoal.cli.run import add_launch_arguments, announce, detect_cluster, spec_from_args, start
from shoal.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="dataset tools: replicate to every node")
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", parser_class=type(parser))
    tools.required = True

    replicate = tools.add_parser(
        "replicate", help="copy SRC on node 0 to DEST on every node (no shared filesystem)",
        description="Run on every node with the launch flags of `shoal run` (one process per "
        "node by default). Node 0 hashes SRC (a directory or a file); every node compares "
        "DEST with it; only the chunks some node lacks are broadcast over the job's process "
        "group. Each file is checked (sha256) before it is renamed into place; a rerun "
        "resumes an interrupted copy, repairs a damaged one and skips what is in place.")
    add_launch_arguments(replicate)
    replicate.add_argument("--chunk-mb", type=int, default=16,
                           help="size of the pieces that are hashed and sent (default 16)")
    replicate.add_argument("src", metavar="SRC", help="directory or file on node 0")
    replicate.add_argument("dest", metavar="DEST", help="where every node keeps its copy")
    replicate.set_defaults(handler=replicate_command, command="data replicate")


def _absolute(path: str) -> str:
    # A trailing slash says "into this directory" for a single-file SRC: keep it.
    return os.path.abspath(path) + (os.sep if path.endswith(os.sep) else "")


def replicate_command(args: argparse.Namespace) -> int:
    if args.chunk_mb < 1:
        raise UsageError(f"--chunk-mb must be at least 1, got {args.chunk_mb}")
    src, dest = _absolute(args.src), _absolute(args.dest)
    cluster = detect_cluster(args)
    spec = spec_from_args(args, "shoal.data.replicate",
                          [src, dest, "--chunk-mb", str(args.chunk_mb)],
                          module=True, nproc_default=1, cluster=cluster)
    if spec.world_size == 1 and not (cluster is not None and cluster.per_process):
        # One node, one process: nothing crosses a network, so no workers to start.
        from shoal.data.replicate import ReplicateError, replicate

        announce(spec, cluster)
        try:
            summary = replicate(src, dest, chunk_size=args.chunk_mb << 20)
        except ReplicateError as exc:
            sys.stderr.write(f"shoal data replicate: error: {exc}\n")
            return exc.exit_code
        print(summary.nodes[0].describe())
        print(summary.describe())
        return 0
    return start(spec, cluster)
