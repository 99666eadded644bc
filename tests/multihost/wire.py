"""A cable with latency between two test hosts, in user space, for kernels without netem.

    python tests/multihost/wire.py NS_A NS_B ADDR_A/24 ADDR_B/24 --delay 0.005

Makes a TAP device in each network namespace (named ``eth0``, with the given address) and
copies every Ethernet frame that leaves one to the other ``--delay`` seconds later, in
order. Bandwidth is limited separately, by a qdisc on each ``eth0`` (tbf works on TAP
devices). Prints ``ready`` once both ends are up, then runs until killed; the devices
vanish with the process. Needs root and /dev/net/tun.
"""

import argparse
import collections
import fcntl
import os
import select
import struct
import subprocess
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000


def _tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _plug(name: str, namespace: str, address: str) -> None:
    """Move TAP ``name`` into ``namespace`` as eth0 (its file descriptor stays ours)."""
    _ip("link", "set", name, "netns", namespace)
    _ip("-n", namespace, "link", "set", name, "name", "eth0")
    _ip("-n", namespace, "addr", "add", address, "dev", "eth0")
    _ip("-n", namespace, "link", "set", "eth0", "up")


def relay(a: int, b: int, delay: float) -> None:
    """Copy frames a -> b and b -> a, each ``delay`` seconds after it was read."""
    waiting = {a: collections.deque(), b: collections.deque()}  # frames due to be written
    other = {a: b, b: a}
    while True:
        heads = [q[0][0] for q in waiting.values() if q]
        timeout = max(0.0, min(heads) - time.monotonic()) if heads else None
        readable, _, _ = select.select([a, b], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                waiting[other[fd]].append((now + delay, frame))
        now = time.monotonic()
        for fd, queue in waiting.items():
            while queue and queue[0][0] <= now:
                try:
                    os.write(fd, queue.popleft()[1])
                except OSError:
                    pass  # the receiving end is down: the frame is lost, as on a cable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("namespaces", nargs=2)
    parser.add_argument("addresses", nargs=2)
    parser.add_argument("--delay", type=float, required=True, help="seconds, one way")
    args = parser.parse_args()
    names = [f"shw{os.getpid() % 100000}{end}" for end in "ab"]
    fds = [_tap(name) for name in names]
    for name, namespace, address in zip(names, args.namespaces, args.addresses, strict=True):
        _plug(name, namespace, address)
    print("ready", flush=True)
    sys.stdout.close()
    relay(fds[0], fds[1], args.delay)


if __name__ == "__main__":
    main()
