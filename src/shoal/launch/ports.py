"""Port helpers: pick a free port, or say clearly that a requested one is taken."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import tempfile
from collections import deque

try:
    import fcntl
except ImportError:  # Windows: no claims, the draw alone
    fcntl = None  # type: ignore[assignment]

from shoal.errors import UsageError

# free_port draws from _LOWEST up to the ephemeral range (Linux: 32768 on), at most to
# _HIGHEST: above the ports services are usually set to (5000, 6006, 8080, ...), below
# Kubernetes' NodePorts (30000 on), and never torchrun's and shoal's default ports.
_LOWEST, _HIGHEST = 15000, 30000
_NAMED = range(29400, 29511)  # torchrun's c10d endpoint (29400), MASTER_PORT (29500) and next
_TRIES = 64
# Ports this process claimed (``_claim``), the oldest first: the lock of each is held while
# the process lives, or until it has claimed this many more.
_KEPT_CLAIMS = 32
_claims: deque[int] = deque()


def ephemeral_ports() -> range:
    """The ports the OS hands out by itself: to ``bind(port 0)`` and to every outgoing
    connection (``/proc/sys/net/ipv4/ip_local_port_range`` on Linux; IANA's 49152..65535
    elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def _bindable(port: int) -> bool:
    """Nothing holds ``port`` on any address, IPv4 or IPv6, right now (a store listens on
    all of them)."""
    for family, address in ((socket.AF_INET6, ("::", port)), (socket.AF_INET, ("", port))):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no such family here
            continue
        with sock:
            try:
                if family == socket.AF_INET6:  # both families at once
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(address)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                continue  # this family cannot bind here: ask the next
            return True
    return False


def _claim(port: int) -> bool:
    """Claim ``port`` among the processes of shoal on this machine: an exclusive lock on a
    file named after it (in the temporary directory's ``shoal-ports``, which keeps these
    empty files), which this process holds while it lives. False where another process
    holds it: it drew that port and has not yet bound it, or still uses it. Where no
    such file can be made, True: the draw alone decides."""
    if fcntl is None:
        return True
    folder = os.path.join(tempfile.gettempdir(), "shoal-ports")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, str(port)), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _claims.append(fd)
    if len(_claims) > _KEPT_CLAIMS:
        with contextlib.suppress(OSError):
            os.close(_claims.popleft())
    return True


def free_port(host: str = "") -> int:
    """A port that is free now and that another process will hardly take before the one it
    is meant for binds it (a store a worker opens seconds later, a daemon still importing).

    A port the OS hands out (port 0) comes from the ephemeral range, from which every
    outgoing connection and every other ``bind(0)`` on the machine draws too: on a busy
    machine one of them can take it in that gap (EADDRINUSE where the store starts). This
    draws at random below that range, where only a program that names the port binds it;
    where the range leaves no room below it, the OS picks (port 0 on ``host``, default
    every address).

    Two processes of shoal that draw at once may draw the same port, and both find it
    free (on a machine that runs many jobs or tests at once, a port in a few thousand
    draws): each claims the port it draws (``_claim``), and none takes one that another
    has claimed."""
    top = min(ephemeral_ports().start, _HIGHEST)
    if top > _LOWEST + 1000:
        draw = random.SystemRandom()
        for _ in range(_TRIES):
            port = draw.randrange(_LOWEST, top)
            if port not in _NAMED and _claim(port) and _bindable(port):
                return port
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
