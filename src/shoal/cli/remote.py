"""`shoal remote serve`: hold a module on this machine's device and run its forward and
backward for trainers (the reference remote tier's server)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from shoal.errors import UsageError
from shoal.extras import require

# The server's defaults (shoal.remote.server.ServeLimits, service.SESSION_TTL_S), written
# out so that the CLI starts without importing torch and grpc.
MAX_CALL_MB, READ_TIMEOUT_S, SESSION_TTL_S = 1024, 10.0, 600.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("remote", help="the remote hardware tier: serve a module")
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", parser_class=type(parser))
    tools.required = True
    serve = tools.add_parser(
        "serve", help="run a module's forward and backward for trainers, over gRPC",
        description="Build the module with --module (and --args), keep it on --device, and "
        "serve its forward and backward to the trainers whose run config names this "
        "endpoint in remote_hardware. Binds 127.0.0.1 unless --host says otherwise; any "
        "other address needs TLS (--tls-cert, --tls-key) unless --insecure, and a token.")
    serve.add_argument("--module", required=True, metavar="PKG.MODULE:BUILDER",
                       help="import path of a function (or class) that returns the nn.Module")
    serve.add_argument("--args", default="{}", metavar="YAML",
                       help="keyword arguments for the builder, as a YAML mapping "
                       "(e.g. '{width: 64}')")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=50051,
                       help="port (default 50051; 0: a free one, printed)")
    serve.add_argument("--device", default=None,
                       help="where the module runs (default: cuda when there is one, else cpu)")
    serve.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="the server's certificate (chain); with --tls-key, calls are TLS")
    serve.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    serve.add_argument("--token-file", default=None, metavar="FILE",
                       help="trainers must send the token on FILE's first line")
    serve.add_argument("--insecure", action="store_true",
                       help="allow plain text on a non-loopback --host")
    serve.add_argument("--threads", type=int, default=None,
                       help="torch's intra-op threads (default: torch's choice)")
    serve.add_argument("--max-call-mb", type=int, default=MAX_CALL_MB,
                       metavar="MIB", help="tensor bytes one call may declare, in MiB "
                       f"(default {MAX_CALL_MB}); a larger call is refused "
                       "before any of it is read")
    serve.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S,
                       metavar="S", help="a call's stream must send each message within S "
                       f"seconds (default {READ_TIMEOUT_S:g})")
    serve.add_argument("--session-ttl", type=float, default=SESSION_TTL_S, metavar="S",
                       help="drop a trainer's session (its copy of the module) once unused "
                       f"for S seconds (default {SESSION_TTL_S:g})")
    serve.set_defaults(handler=serve_command, command="remote serve")


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror}") from None


def serve_command(args: argparse.Namespace) -> int:
    require("remote", "shoal remote serve")
    import torch

    from shoal.config.loader import read_yaml
    from shoal.data.serve import ReplicateError, is_loopback, read_token
    from shoal.launch.ports import check_port_free
    from shoal.remote.server import RemoteServer, ServeLimits, TierService
    from shoal.remote.tier import check_token

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("give --tls-cert and --tls-key together")
    tls = None if args.tls_cert is None else (_read(args.tls_key, "--tls-key"),
                                              _read(args.tls_cert, "--tls-cert"))
    if not is_loopback(args.host):
        if tls is None and not args.insecure:
            raise UsageError(f"--host {args.host} is not loopback: give --tls-cert and "
                             "--tls-key so that tensors and token travel encrypted, or "
                             "--insecure to serve in plain text")
        if args.token_file is None:
            raise UsageError(f"--host {args.host} is not loopback: other machines could use "
                             "this server, so give --token-file")
    try:
        token = read_token(None, args.token_file)
    except ReplicateError as exc:
        raise UsageError(str(exc)) from None
    if token is not None:
        check_token(token, f"--token-file {args.token_file}")
    for flag, value in (("--max-call-mb", args.max_call_mb), ("--read-timeout",
                        args.read_timeout), ("--session-ttl", args.session_ttl)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value:g}")
    if os.getcwd() not in sys.path:  # --module imports from here, as `python -m` would
        sys.path.insert(0, os.getcwd())
    builder_args = read_yaml(args.args) or {}
    if not isinstance(builder_args, dict):
        raise UsageError(f"--args must be a YAML mapping, got {args.args!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.port:
        check_port_free(args.host, args.port, "--port", "pick another --port, or 0 for a "
                        "free one")
    service = TierService(args.module, builder_args, args.device, token, args.session_ttl)
    limits = ServeLimits(max_call_bytes=args.max_call_mb << 20, read_timeout_s=args.read_timeout)
    server = RemoteServer(service, args.host, args.port, tls, limits=limits).start()
    count = sum(p.numel() for p in service.base.parameters())
    print(f"shoal remote: serving {args.module} ({count:,} parameters, {service.device}) at "
          f"{args.host}:{server.port} ({'TLS' if tls else 'plain text'}, "
          f"{'token required' if token else 'no token'})", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    print("shoal remote: stopping", file=sys.stderr, flush=True)
    server.stop()
    return 0
