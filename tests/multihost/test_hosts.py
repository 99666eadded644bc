"""The test hosts themselves: they reach each other, a cut link cuts, a wire delays."""

import subprocess
import sys

import pytest

from tests.multihost.hosts import Hosts, unavailable

PROBE = """
import socket, sys, time
server = socket.socket()
server.bind(("0.0.0.0", 0))
server.listen()
port = server.getsockname()[1]
print(port, flush=True)
while True:
    server.accept()
"""

CONNECT = """
import socket, sys, time
start = time.perf_counter()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
except OSError as exc:
    print("failed", type(exc).__name__)
else:
    print("connected", time.perf_counter() - start)
"""


def _connect(hosts: Hosts, port: int) -> str:
    done = hosts.run(0, [sys.executable, "-c", CONNECT, hosts.addr(1), str(port)],
                     capture_output=True, text=True, timeout=30)
    return done.stdout.strip()


@pytest.mark.parametrize("delay", [None, 0.02])
def test_hosts_reach_each_other_until_the_link_is_cut(make_hosts, delay):
    if delay is None:
        hosts = make_hosts(2)
    else:  # the user-space wire (used where the kernel has no netem)
        why = unavailable()
        if why:
            pytest.skip(why)
        hosts = Hosts(2, wire_delay=delay).__enter__()
    try:
        server = hosts.popen(1, [sys.executable, "-c", PROBE], stdout=subprocess.PIPE,
                             text=True)
        port = int(server.stdout.readline())
        verdict, seconds = _connect(hosts, port).split()
        assert verdict == "connected"
        if delay is not None:  # a TCP handshake is one round trip: two one-way delays
            assert float(seconds) >= 2 * delay
        hosts.set_link(1, up=False)
        assert _connect(hosts, port).startswith("failed")
    finally:
        hosts.close()
