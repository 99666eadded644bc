"""Which ``Host`` headers the dashboard answers: the names it is really reached by.

A web page the user visits can point a name of its own at 127.0.0.1 (DNS rebinding) and
then read the dashboard as if it were its own site; the browser sends that name in
``Host``. So a request is answered only when its ``Host`` is one of the server's own
names: the address it is bound to, loopback names when it is bound to loopback, this
machine's name and addresses when it is bound to all of them or to one of them, and the
names the user allows (a proxy's). The port is not checked (an SSH tunnel or a proxy may
show another one). A request without ``Host`` (HTTP/1.0) cannot come from a browser
and is answered.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import cast

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True)
class HostRule:
    bound: str = "127.0.0.1"
    """The address the server listens on (``--host``)."""
    allowed: tuple[str, ...] = ()
    """More names to answer to (``--allow-host``: a proxy's or a DNS alias's)."""
    any_host: bool = False
    """Answer every ``Host`` (``--allow-any-host``: a proxy checks it instead)."""
    names: frozenset[str] = field(init=False, repr=False)
    """Every name answered (worked out once, from the fields above)."""

    def __post_init__(self):
        for name in self.allowed:
            if not _name(name) or any(c in name for c in "/@ \t\\"):
                raise ValueError(f"{name!r} is no host name or address (give one without a "
                                 "scheme or path)")
        object.__setattr__(self, "names", frozenset(
            {_name(self.bound), *map(_name, self.allowed), *_own_names(self.bound)}))

    def allows(self, host: str | None) -> bool:
        """Whether a request whose ``Host`` header is ``host`` is answered."""
        return self.any_host or host is None or _name(host) in self.names - {""}


def _name(host: str) -> str:
    """``Host``'s name without its port or brackets, lower case: '[::1]:80' -> '::1'; ''
    for a value that is not a name with an optional numeric port."""
    host = host.strip().lower()
    if host.startswith("["):  # [IPv6] or [IPv6]:port, nothing else
        end = host.find("]")
        rest = host[end + 1:]
        if end < 0 or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return ""
        return host[1:end]
    name, port = (host.split(":") if host.count(":") == 1 else (host, ""))
    return "" if port and not port.isdigit() else name.rstrip(".")


def _own_names(bound: str) -> set[str]:
    """The names a server bound to ``bound`` is reached by, besides ``bound`` itself."""
    bound = _name(bound)
    try:
        loopback = bound == "localhost" or ipaddress.ip_address(bound).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return set(LOOPBACK)
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    if bound in WILDCARDS:  # every interface: each of its addresses, loopback's too
        from shoal.runtime.info import network_interfaces

        names |= LOOPBACK | {a.split("%")[0].lower()
                             for addresses in network_interfaces().values() for a in addresses}
    else:  # a name given to --host: the addresses it stands for
        try:
            names |= {cast(str, info[4][0]).lower()  # an AF_INET(6) address: a str
                      for info in socket.getaddrinfo(bound, None)}
        except OSError:
            pass
    return names
