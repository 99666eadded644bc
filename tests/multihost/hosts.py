"""Test hosts on one machine: Linux network namespaces joined by a bridge.

    with Hosts(2) as hosts:
        proc = hosts.popen(0, [sys.executable, "-m", "shoal", ...])
        hosts.set_link(1, up=False)           # cut host 1 off the network
        hosts.netem(0, rate="100mbit", delay="5ms")

Each host is a namespace with one interface, ``eth0``, whose address is in 198.18.0.0/15
(reserved for benchmarking networks: no real network uses it), and its own hostname
(``host0``, ``host1``, ...; a UTS namespace per command). The hosts' other ends are joined
by a bridge in the root namespace, which has no address itself: the hosts reach each other
and nothing else. Everything is removed on exit, with every process still running inside.
Needs root and iproute2; ``unavailable()`` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

SUBNET_PREFIX = "198.18"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"shoalprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """``n`` hosts named host0..host{n-1} at 198.18.<net>.1.. (``net`` from the pid)."""

    def __init__(self, n: int):
        self.n = n
        tag = os.getpid() % 100000
        self.net = tag % 250 + 1  # concurrent test runs use different /24s
        self.bridge = f"shbr{tag}"
        self.namespaces = [f"shoal{tag}h{i}" for i in range(n)]
        self._veths = [f"sh{tag}v{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def addr(self, i: int) -> str:
        return f"{SUBNET_PREFIX}.{self.net}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"host{i}"

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, (ns, veth) in enumerate(zip(self.namespaces, self._veths, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``i`` (its namespace and hostname)."""
        return ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname(i)} && exec "$@"', "sh", *argv]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``i``; it is killed when the hosts are removed."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(i, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float = 60, **kwargs
            ) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(i, argv), timeout=timeout, **kwargs)

    def pids(self, i: int) -> list[int]:
        """Every process running inside host ``i``."""
        out = _ip("netns", "pids", self.namespaces[i], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill every process of host ``i`` at once, as a machine that dies."""
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def set_link(self, i: int, up: bool) -> None:
        """Plug host ``i``'s cable in or out (the bridge side, as a switch port)."""
        _ip("link", "set", self._veths[i], "up" if up else "down")

    def netem(self, i: int, rate: str | None = None, delay: str | None = None) -> None:
        """Limit host ``i``'s outgoing bandwidth and add latency (tc netem)."""
        options = [*(["delay", delay] if delay else []), *(["rate", rate] if rate else [])]
        subprocess.run(["tc", "-n", self.namespaces[i], "qdisc", "replace", "dev", "eth0",
                        "root", "netem", *options], check=True, capture_output=True)

    def block_port(self, i: int, port: int) -> None:
        """Drop TCP packets arriving at host ``i`` for ``port`` (a firewall rule)."""
        tc = ["tc", "-n", self.namespaces[i]]
        subprocess.run([*tc, "qdisc", "add", "dev", "eth0", "ingress"], check=True,
                       capture_output=True)
        subprocess.run([*tc, "filter", "add", "dev", "eth0", "parent", "ffff:", "protocol",
                        "ip", "u32", "match", "ip", "protocol", "6", "0xff", "match", "ip",
                        "dport", str(port), "0xffff", "action", "drop"], check=True,
                       capture_output=True)

    def alive(self, i: int) -> list[int]:
        return self.pids(i)

    def close(self) -> None:
        for i in range(self.n):
            if os.path.exists(f"/run/netns/{self.namespaces[i]}"):
                self.kill_all(i)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        for veth in self._veths:
            _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)
