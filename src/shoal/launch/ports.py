"""Port helpers: pick a free port, or say clearly that a requested one is taken."""

from __future__ import annotations

import errno
import socket

from shoal.errors import UsageError


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int, flag: str = "--master-port",
                    advice: str = "leave --master-port out on one node to pick a free one"
                    ) -> None:
    """Raise a UsageError naming the port (given as ``flag``) when something already
    listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port in TIME_WAIT is fine for the store; a live listener still fails.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            what = ("is already in use" if exc.errno == errno.EADDRINUSE
                    else "cannot be listened on")
            raise UsageError(f"{flag} {port} on {host} {what} ({exc.strerror}); "
                             f"choose another port, or {advice}") from None
