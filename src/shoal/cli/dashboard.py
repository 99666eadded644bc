"""`shoal dashboard RUN_DIR...`: every rank of running (or finished) jobs, in a browser.

Also ``--dashboard`` of `shoal train` and `shoal rl`: node 0's launcher serves the run's
dashboard while the job runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from pathlib import Path

from shoal.errors import UsageError
from shoal.extras import require

TOKEN_VARIABLE = "SHOAL_DASHBOARD_TOKEN"


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "dashboard",
        help="serve a live dashboard of run directories",
        description="Serve a page that shows the runs' curves, every rank's step split, "
        "stragglers, resources and alerts, updated as the runs write. Read-only; binds "
        "127.0.0.1 unless --host says otherwise.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (each holds a metrics.jsonl, or will)")
    add_server_arguments(parser, prefix="")
    parser.add_argument("--silence", type=float, default=60.0, metavar="SECONDS",
                        help="alert when a run that has not ended wrote nothing for this long "
                        "(default 60)")
    parser.set_defaults(handler=dashboard_command, command="dashboard")
    return parser


def add_server_arguments(parser: argparse.ArgumentParser, prefix: str) -> None:
    """--{prefix}host, --{prefix}port, --{prefix}allow-host, --{prefix}allow-any-host and
    --token-file."""
    parser.add_argument(f"--{prefix}host", dest="dashboard_host", default="127.0.0.1",
                        help="address the dashboard listens on (default 127.0.0.1: this "
                        "machine only)")
    parser.add_argument(f"--{prefix}port", dest="dashboard_port", type=int, default=8000,
                        help="the dashboard's port (default 8000; 0: any free port)")
    parser.add_argument(f"--{prefix}allow-host", dest="dashboard_allow_hosts", action="append",
                        default=[], metavar="NAME",
                        help="answer requests that name the server NAME too (a proxy's or an "
                        "alias's name; repeatable). Others are refused unless they name its "
                        "address, or localhost on the loopback, or this machine off it")
    parser.add_argument(f"--{prefix}allow-any-host", dest="dashboard_any_host",
                        action="store_true",
                        help="answer whatever Host a request names (behind a proxy that "
                        "checks it)")
    parser.add_argument("--token-file", dest="dashboard_token_file", default=None,
                        help="a file holding the token every request must carry (default: "
                        f"${TOKEN_VARIABLE}; off the loopback, a random one)")


def add_dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    """`shoal train --dashboard`: node 0 serves the run's dashboard while it trains."""
    parser.add_argument("--dashboard", action="store_true",
                        help="serve the run's live dashboard from node 0 while it trains")
    add_server_arguments(parser, prefix="dashboard-")


def _token(args: argparse.Namespace) -> str | None:
    from shoal.data.serve import ReplicateError, is_loopback, read_token

    try:
        token = read_token(None, args.dashboard_token_file)
    except ReplicateError as exc:
        raise UsageError(str(exc)) from None
    token = token or os.environ.get(TOKEN_VARIABLE) or None
    if token is None and not is_loopback(args.dashboard_host):
        return secrets.token_urlsafe(16)
    return token


def open_server(args: argparse.Namespace, directories: list[str | Path], **settings):
    """The dashboard of ``directories``, checked and ready to serve, and what to tell."""
    from shoal.dashboard.hosts import HostRule
    from shoal.dashboard.server import Server, create_app
    from shoal.data.serve import is_loopback
    from shoal.launch.ports import check_port_free

    token = _token(args)
    host = args.dashboard_host
    prefix = "--" if args.command == "dashboard" else "--dashboard-"
    try:
        hosts = HostRule(host, tuple(args.dashboard_allow_hosts), args.dashboard_any_host)
    except ValueError as exc:
        raise UsageError(f"{prefix}allow-host: {exc}") from None
    flag = f"{prefix}port"
    check_port_free(host, args.dashboard_port, flag, f"give {flag} 0 to pick a free one")
    if not is_loopback(host):
        print(f"shoal dashboard: warning: listening on {host}, reachable from other "
              "machines; every request needs the token", file=sys.stderr, flush=True)
    app = create_app(directories, token=token, hosts=hosts, **settings)
    return Server(app, host, args.dashboard_port), token


def dashboard_command(args: argparse.Namespace) -> int:
    require("dashboard", "the dashboard")
    from shoal.dashboard.alerts import AlertSettings
    from shoal.dashboard.server import url_of

    for run in args.runs:
        if not Path(run).is_dir():
            raise UsageError(f"{run}: no such run directory")
    if args.silence <= 0:
        raise UsageError("--silence must be positive")
    server, token = open_server(args, args.runs,
                                settings=AlertSettings(silence_s=args.silence))
    server.start()
    print(f"shoal dashboard: {len(args.runs)} run(s) at "
          f"{url_of(args.dashboard_host, server.port, token)}  (Ctrl-C stops it)", flush=True)
    try:
        while server.thread.is_alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        print("shoal dashboard: stopped", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return 0


@contextlib.contextmanager
def serve_during(args: argparse.Namespace, directory: str | None):
    """`shoal train --dashboard`: serve ``directory``'s dashboard while the job runs (on
    node 0: elsewhere ``directory`` is None and nothing is served)."""
    if not getattr(args, "dashboard", False) or directory is None:
        yield
        return
    from shoal.dashboard.server import url_of  # launch_run checked shoal[dashboard] first

    server, token = open_server(args, [directory])
    server.start()
    print(f"shoal: the run's dashboard is at {url_of(args.dashboard_host, server.port, token)}",
          flush=True)
    try:
        yield
    finally:
        server.stop()
