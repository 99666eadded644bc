"""The job's lighthouse as a daemon of its own: started by the launcher of node 0 before the
replica groups, stopped by its pid when they are done.

    python -m shoal.ft.lighthouse --bind 127.0.0.1:PORT --min-replicas R --config JSON
                                  [--parent PID]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from shoal.ft.config import FaultToleranceConfig
from shoal.runtime.parent import die_with_parent


@dataclass
class Lighthouse:
    """A lighthouse process this launcher started."""

    process: subprocess.Popen
    address: str
    """http://HOST:PORT, what the groups' managers connect to."""
    command: list[str]
    """How it was started (a lighthouse that died is started again the same way)."""

    def restart(self) -> None:
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL)

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at a lighthouse's address (http://HOST:PORT)."""
    parts = urlsplit(address)
    try:
        # ignore: typeshed's port is int; a None one (getaddrinfo takes it) is an OSError here
        with socket.create_connection((parts.hostname, parts.port),  # type: ignore[arg-type]
                                      timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def start_lighthouse(host: str, port: int, min_replicas: int,
                     config: FaultToleranceConfig) -> Lighthouse:
    """Start the daemon; it listens on ``host:port`` as soon as its import is done (the
    groups' managers retry their first connection meanwhile)."""
    command = [sys.executable, "-m", "shoal.ft.lighthouse", "--bind", f"{host}:{port}",
               "--min-replicas", str(min_replicas), "--config", config.model_dump_json(),
               "--parent", str(os.getpid())]
    return Lighthouse(subprocess.Popen(command, stdin=subprocess.DEVNULL),
                      f"http://{host}:{port}", command)


def main() -> None:
    parser = argparse.ArgumentParser(prog="shoal.ft.lighthouse")
    parser.add_argument("--bind", required=True)
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--parent", type=int, default=None,
                        help="the launcher's pid: this daemon ends with it")
    args = parser.parse_args()
    if args.parent is not None:  # no lighthouse outlives the launcher that started it
        die_with_parent(signal.SIGTERM, args.parent)
    from shoal.ft.engine import serve_lighthouse

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = serve_lighthouse(args.bind, args.min_replicas,
                              FaultToleranceConfig.model_validate_json(args.config))
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
