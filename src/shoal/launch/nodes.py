"""Which nodes of a multi-node job are still heard from, to name a lost host in a hang report.

Every node's launcher keeps a counter in the job's rendezvous store (the TCP store on the
master, or the c10d endpoint) and bumps it every second; it also reads everyone else's. A
node whose counter stopped moving is down or cut off; a store that stopped answering means
this node lost the master. Workers hung in a collective cannot tell which peer is missing
(TCP to a host whose cable is out just waits); the launchers can.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

_NODES = "shoal/nodes"
_BEAT = "shoal/beat/"


class NodeWatch(threading.Thread):
    """Beats for this node in the store at ``host:port`` and listens to the others."""

    def __init__(self, host: str, port: int, address: str, interval: float = 1.0):
        super().__init__(daemon=True, name="shoal-node-watch")
        self.host, self.port, self.interval = host, port, interval
        self.address = address
        self.me = f"{socket.gethostname()} ({address})"
        self._stopping = threading.Event()
        self._store: TCPStore | None = None
        self._heard: dict[str, tuple[int, float]] = {}  # node -> (counter, when it moved)
        self._store_answered = time.monotonic()
        self._registered = False
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Stop beating, and wait for a store call in flight: one still running when the
        interpreter exits (a daemon thread) aborts the launcher ("terminate called without
        an active exception") where the master's store is gone, and the node then exits
        134 instead of its own code (a SLURM job requeued on a time limit fails instead)."""
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=max(2.0, 3 * self.interval) + 2.0)  # the store's timeout

    def run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - unreachable or gone: silence is the signal
                self._store = None

    def _beat(self) -> None:
        if self._store is None:
            self._store = TCPStore(self.host, self.port, is_master=False,
                                   timeout=timedelta(seconds=max(2.0, 3 * self.interval)),
                                   wait_for_workers=False)
        store = self._store
        if not self._registered:
            # (TCPStore.append exists, but torch's stubs leave it out)
            store.append(_NODES, self.me + "\n")  # type: ignore[attr-defined]
            self._registered = True
        store.add(_BEAT + self.me, 1)
        nodes = [n for n in store.get(_NODES).decode().splitlines() if n]
        counts = [int(v) for v in store.multi_get([_BEAT + n for n in nodes])]
        now = time.monotonic()
        with self._lock:
            self._store_answered = now
            for node, count in zip(nodes, counts, strict=True):
                if self._heard.get(node, (None,))[0] != count:
                    self._heard[node] = (count, now)

    def known(self) -> list[str]:
        """Every other node heard from so far, as 'HOSTNAME (ADDRESS)'."""
        with self._lock:
            return sorted(node for node in self._heard if node != self.me)

    def silent(self, longer_than: float) -> list[str]:
        """One line per node (or the store) not heard from for more than ``longer_than`` s."""
        now = time.monotonic()
        with self._lock:
            if not self._registered:
                return [f"this node, {self.me}, never reached the rendezvous store at "
                        f"{self.host}:{self.port}"]
            if now - self._store_answered > longer_than:
                return [f"this node, {self.me}, lost the master: the rendezvous store at "
                        f"{self.host}:{self.port} has not answered for "
                        f"{now - self._store_answered:.0f} s (master down or unreachable)"]
            return [f"node {node} has not been heard from for {now - moved:.0f} s "
                    "(down or unreachable)"
                    for node, (_, moved) in sorted(self._heard.items())
                    if node != self.me and now - moved > longer_than]
