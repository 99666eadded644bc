"""Which network interface and address this host uses to reach another host.

A multi-node job must tell gloo (and NCCL) which interface to use: by default gloo takes the
address the hostname resolves to, which on many clusters (and in containers) is a loopback
or management address the other nodes cannot reach. The interface that routes to the
master is the one the other nodes can reach us on too.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import cast

from shoal.errors import UsageError


def resolve(host: str) -> tuple[socket.AddressFamily, str]:
    """``host`` (name or address) as (address family, numeric address)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UsageError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    return family, cast(str, sockaddr[0])  # (host, port, ...) of AF_INET or AF_INET6


def route_to(host: str) -> tuple[str | None, str]:
    """(interface name, local address) of the route from this host to ``host``.

    A UDP socket's connect only picks the route; no packet is sent.
    """
    family, address = resolve(host)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError as exc:
            raise UsageError(f"no route from this host to {host} ({address}): "
                             f"{exc.strerror}") from None
        local = probe.getsockname()[0]
    import psutil  # multi-node only: a job of one node starts without it

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name, local
    return None, local


def choose_interface(master_addr: str, node: str) -> tuple[str | None, str]:
    """Point gloo and NCCL at the interface that reaches the master (unless the user did).

    Returns the interface and this node's address on it."""
    name, local = route_to(master_addr)
    if name is None:
        return name, local
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if variable not in os.environ:
            os.environ[variable] = name
    chosen = os.environ["GLOO_SOCKET_IFNAME"]
    print(f"shoal: {node} reaches the master {master_addr} through {chosen} ({local})",
          file=sys.stderr, flush=True)
    return name, local
