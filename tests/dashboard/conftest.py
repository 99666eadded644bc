"""A dashboard served on a thread of the test process, on a free loopback port."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from shoal.dashboard.alerts import AlertSettings
from shoal.dashboard.server import Server, create_app


@pytest.fixture
def serve():
    """serve(dirs, token=None, said=None, hosts=None, **settings) -> the base URL; stopped
    after the test (``serve.servers``: the servers started)."""
    servers = []

    def start(directories, token=None, said=None, hosts=None, **settings):
        app = create_app(directories, token=token, interval=0.2,
                         settings=AlertSettings(**settings),
                         say=said.append if said is not None else None,
                         **({"hosts": hosts} if hosts is not None else {}))
        server = Server(app, "127.0.0.1", 0).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}"

    start.servers = servers
    yield start
    for server in servers:
        server.stop()


class EventStream:
    """The server-sent events of one page, read as they come."""

    def __init__(self, base: str, query: str = "", headers: dict | None = None):
        host, port = base.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)
        self.conn.request("GET", "/api/events" + query, headers=headers or {})
        self.response = self.conn.getresponse()

    def next(self, timeout: float = 10.0) -> tuple[str, object]:
        """The next event (name, data), keep-alive comments skipped."""
        deadline = time.monotonic() + timeout
        name, data = None, []
        while time.monotonic() < deadline:
            line = self.response.fp.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and name:
                return name, json.loads("".join(data))
        raise TimeoutError("no event")

    def close(self):
        self.conn.close()
