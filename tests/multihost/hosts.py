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
Needs root and iproute2; ``unavailable()`` says why not. ``netem_unavailable()`` says why
latency cannot be added (kernels built without the netem qdisc, such as some VM kernels).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
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


def netem_unavailable() -> str | None:
    """Why the netem qdisc (latency) cannot be used here, or None when it can."""
    with Hosts(1) as probe:
        try:
            probe.netem(0, delay="1ms")
        except RuntimeError as exc:
            return f"this kernel has no netem qdisc ({exc})"
    return None


class Hosts:
    """``n`` hosts named host0..host{n-1} at 198.18.<net>.1.. (``net`` from the pid)."""

    def __init__(self, n: int, wire_delay: float | None = None):
        if wire_delay is not None and n != 2:
            raise ValueError("a wire joins exactly 2 hosts")
        self.n = n
        self.wire_delay = wire_delay
        self._wire: subprocess.Popen | None = None
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

    def _write_hosts_files(self) -> None:
        """Each host resolves every host's name, as on a cluster (``ip netns exec`` mounts
        /etc/netns/NAME/hosts over /etc/hosts)."""
        table = "127.0.0.1 localhost\n" + "".join(
            f"{self.addr(i)} {self.hostname(i)}\n" for i in range(self.n))
        for ns in self.namespaces:
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(table)

    def __enter__(self) -> Hosts:
        self._write_hosts_files()
        if self.wire_delay is not None:
            return self._wired()
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

    def _wired(self) -> Hosts:
        """Two hosts joined by a user-space cable with latency (wire.py) instead of a bridge."""
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            self._wire = subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(__file__), "wire.py"),
                 *self.namespaces, *(f"{self.addr(i)}/24" for i in range(2)),
                 "--delay", str(self.wire_delay)], stdout=subprocess.PIPE, text=True)
            if self._wire.stdout.readline().strip() != "ready":
                raise RuntimeError("the wire between the test hosts did not come up")
        except BaseException:
            self.close()
            raise
        return self

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
        if self._wire is not None:
            _ip("-n", self.namespaces[i], "link", "set", "eth0", "up" if up else "down")
        else:
            _ip("link", "set", self._veths[i], "up" if up else "down")

    def netem(self, i: int, rate: str | None = None, delay: str | None = None) -> None:
        """Limit host ``i``'s outgoing bandwidth and add latency (tc netem)."""
        options = [*(["delay", delay] if delay else []), *(["rate", rate] if rate else [])]
        self._qdisc(i, "netem", *options)

    def limit(self, i: int, rate: str) -> None:
        """Limit host ``i``'s outgoing bandwidth only (a token bucket: kernels without
        netem have it)."""
        self._qdisc(i, "tbf", "rate", rate, "burst", "64kb", "latency", "50ms")

    def unlimit(self, i: int) -> None:
        subprocess.run(["tc", "-n", self.namespaces[i], "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True)

    def _qdisc(self, i: int, *qdisc: str) -> None:
        done = subprocess.run(["tc", "-n", self.namespaces[i], "qdisc", "replace", "dev",
                               "eth0", "root", *qdisc], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"tc qdisc {qdisc[0]} on host{i}: {done.stderr.strip()}")

    def block_port(self, i: int, port: int) -> None:
        """Drop TCP packets arriving at host ``i``'s eth0 for ``port`` (a firewall rule).

        A policy-routing rule (``blackhole``) rather than a tc filter: it needs no traffic
        control modules in the kernel (many VM kernels have no ``act_gact``). The rule must
        come before the lookup of local addresses (priority 0), which moves to 100 once.
        Connections from the host to itself (loopback) are not affected.
        """
        ns = self.namespaces[i]
        if _ip("-n", ns, "rule", "show", "pref", "0").stdout.strip():
            _ip("-n", ns, "rule", "add", "pref", "100", "lookup", "local")
            _ip("-n", ns, "rule", "del", "pref", "0")
        _ip("-n", ns, "rule", "add", "pref", "10", "iif", "eth0", "ipproto", "tcp", "dport",
            str(port), "blackhole")

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
        if self._wire is not None:
            self._wire.kill()
            self._wire.wait()
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for veth in self._veths:
            _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)
