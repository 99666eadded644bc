"""`shoal data`: copy a dataset from node 0 to every node of a job (`replicate`), or serve it
to nodes that join later (`serve`) and fetch it there (`fetch`)."""

from __future__ import annotations

import argparse
import os
import sys

from shoal.cli.run import add_launch_arguments, announce, detect_cluster, spec_from_args, start
from shoal.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data", help="dataset tools: replicate to every node, serve, fetch")
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

    serve = tools.add_parser(
        "serve", help="serve DIR read-only over HTTP, for nodes that fetch it later",
        description="Hash DIR once (as `shoal data replicate` does), then serve its manifest "
        "and chunks, read-only, until interrupted. Binds 127.0.0.1 unless --host says "
        "otherwise; any other address needs a token, which clients then must send.")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    _add_token_arguments(serve, "clients must send")
    serve.add_argument("--chunk-mb", type=int, default=16,
                       help="size of the pieces that are hashed and sent (default 16)")
    serve.add_argument("dir", metavar="DIR", help="the dataset: a directory or a file")
    serve.set_defaults(handler=serve_command, command="data serve")

    fetch = tools.add_parser(
        "fetch", help="copy what `shoal data serve` serves at URL into DEST",
        description="Fetch the dataset served at URL into DEST: files in place are skipped, "
        "an interrupted or damaged copy is resumed or repaired, every chunk and every file "
        "is checked (sha256). Run it before a node's workers start, or use "
        "`shoal run --fetch-data URL DEST`.")
    _add_token_arguments(fetch, "the server wants")
    fetch.add_argument("--retries", type=int, default=5,
                       help="ask again for a chunk that failed or was wrong, up to N times "
                       "(default 5)")
    fetch.add_argument("url", metavar="URL", help="http://HOST:PORT that `shoal data serve` "
                       "printed")
    fetch.add_argument("dest", metavar="DEST", help="where this node keeps its copy")
    fetch.set_defaults(handler=fetch_command, command="data fetch")


def _add_token_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--token", default=None, help=f"the token {what} (visible to ps: "
                        "prefer --token-file)")
    tokens.add_argument("--token-file", default=None, metavar="FILE",
                        help="read the token from the first line of FILE")


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


def serve_command(args: argparse.Namespace) -> int:
    from shoal.data.serve import ReplicateError, read_token, serve

    if args.chunk_mb < 1:
        raise UsageError(f"--chunk-mb must be at least 1, got {args.chunk_mb}")
    try:
        token = read_token(args.token, args.token_file)
    except ReplicateError as exc:
        raise UsageError(str(exc)) from None
    return serve(os.path.abspath(args.dir), args.host, args.port, token, args.chunk_mb << 20)


def fetch_command(args: argparse.Namespace) -> int:
    from shoal.data.fetch import fetch_command as fetch

    return fetch(args.url, args.dest, args.token, args.token_file, args.retries)
