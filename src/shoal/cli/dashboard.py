"""`shoal dashboard RUN_DIR...`: every rank of running (or finished) jobs, in a browser.

Also ``--dashboard`` of `shoal train` and `shoal rl`: node 0's launcher serves the run's
dashboard while the job runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import sys
from pathlib import Path

from shoal.errors import UsageError

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
    add_server_arguments(parser, port_flag="--port")
    parser.add_argument("--silence", type=float, default=60.0, metavar="SECONDS",
                        help="alert when a run that has not ended wrote nothing for this long "
                        "(default 60)")
    parser.set_defaults(handler=dashboard_command, command="dashboard")
    return parser


def add_server_arguments(parser: argparse.ArgumentParser, port_flag: str) -> None:
    parser.add_argument("--host" if port_flag == "--port" else "--dashboard-host",
                        dest="dashboard_host", default="127.0.0.1",
                        help="address the dashboard listens on (default 127.0.0.1: this "
                        "machine only)")
    parser.add_argument(port_flag, dest="dashboard_port", type=int, default=8000,
                        help="the dashboard's port (default 8000; 0: any free port)")
    parser.add_argument("--token-file", dest="dashboard_token_file", default=None,
                        help="a file holding the token every request must carry (default: "
                        f"${TOKEN_VARIABLE}; off the loopback, a random one)")


def add_dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    """`shoal train --dashboard`: node 0 serves the run's dashboard while it trains."""
    parser.add_argument("--dashboard", action="store_true",
                        help="serve the run's live dashboard from node 0 while it trains")
    add_server_arguments(parser, port_flag="--dashboard-port")


def _token(args: argparse.Namespace) -> str | None:
    if args.dashboard_token_file:
        try:
            token = Path(args.dashboard_token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(f"--token-file {args.dashboard_token_file}: {exc.strerror}") \
                from None
        if not token:
            raise UsageError(f"--token-file {args.dashboard_token_file} is empty")
        return token
    if os.environ.get(TOKEN_VARIABLE):
        return os.environ[TOKEN_VARIABLE]
    if not _loopback(args.dashboard_host):
        return secrets.token_urlsafe(16)
    return None


def _loopback(host: str) -> bool:
    from shoal.dashboard.server import LOOPBACK

    return host in LOOPBACK or host.startswith("127.")


def _check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"the dashboard cannot listen on {host}:{port}: {exc.strerror} "
                             "(choose another port; 0 picks a free one)") from None


def open_server(args: argparse.Namespace, directories: list[str], **settings):
    """The dashboard of ``directories``, checked and ready to serve, and what to tell."""
    from shoal.dashboard.server import Server, create_app

    token = _token(args)
    host = args.dashboard_host
    _check_port(host, args.dashboard_port)
    if not _loopback(host):
        print(f"shoal dashboard: warning: listening on {host}, reachable from other "
              "machines; every request needs the token", file=sys.stderr, flush=True)
    app = create_app(directories, token=token, **settings)
    return Server(app, host, args.dashboard_port), token


def dashboard_command(args: argparse.Namespace) -> int:
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
    from shoal.dashboard.server import url_of

    server, token = open_server(args, [directory])
    server.start()
    print(f"shoal: the run's dashboard is at {url_of(args.dashboard_host, server.port, token)}",
          flush=True)
    try:
        yield
    finally:
        server.stop()
