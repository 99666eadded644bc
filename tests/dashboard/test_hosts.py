"""The Host check: a page of another site that points its own name at the dashboard's
address (DNS rebinding) is refused; the names the server is really reached by are not."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys

import pytest

from shoal.dashboard.hosts import HostRule
from tests.dashboard.synthetic import event_line, run_lines

FOREIGN = ("evil.example:8000", "evil.example", "127.0.0.1.evil.example", "localhost.evil",
           "[::1].evil", "", "127.0.0.1@evil.example", "evil.example:8000:8000")


def _get(base: str, path: str, host: str | None) -> tuple[int, bytes, dict]:
    address, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(address, int(port), timeout=10)
    conn.request("GET", path, headers={} if host is None else {"Host": host})
    response = conn.getresponse()
    # An event stream never ends: its first bytes are enough.
    body = response.read1(200) if response.status == 200 and "events" in path else \
        response.read()
    conn.close()
    return response.status, body, dict(response.getheaders())


@pytest.fixture
def run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join([event_line("start", 0)] + run_lines(5)) + "\n")
    (tmp_path / "config.yaml").write_text("x: 1\n")
    return tmp_path


def test_a_loopback_server_answers_its_loopback_names_only():
    rule = HostRule("127.0.0.1")
    for host in ("127.0.0.1:8000", "127.0.0.1", "localhost:8000", "LocalHost", "localhost.",
                 "[::1]:8000", "[::1]", None):
        assert rule.allows(host), host
    for host in FOREIGN + (socket.gethostname(),):
        assert not rule.allows(host), host
    assert HostRule("::1").allows("[::1]:9") and HostRule("localhost").allows("127.0.0.1")


def test_a_server_on_every_interface_answers_this_machines_names():
    rule = HostRule("0.0.0.0")
    for host in (socket.gethostname(), f"{socket.gethostname()}:8000", "127.0.0.1:1",
                 "localhost"):
        assert rule.allows(host), host
    assert not any(rule.allows(host) for host in FOREIGN)
    assert HostRule("::").allows("[::1]:8000")


def test_names_allowed_by_hand_and_any_host():
    rule = HostRule("127.0.0.1", allowed=("Dash.Example.org",))
    assert rule.allows("dash.example.org:443") and not rule.allows("evil.example")
    assert all(HostRule("127.0.0.1", any_host=True).allows(host) for host in FOREIGN)
    for bad in ("http://dash.example", "a/b", "", "x y"):
        with pytest.raises(ValueError, match="is no host name or address"):
            HostRule("127.0.0.1", allowed=(bad,))


def test_a_foreign_host_is_refused_on_every_path(serve, run):
    base = serve([run])
    for path in ("/", "/static/dashboard.js", "/api/snapshot", "/api/events",
                 "/api/runs/0/files/config.yaml", "/nowhere"):
        status, body, headers = _get(base, path, "evil.example:8000")
        assert status == 403, path
        assert body == (b"shoal dashboard: Host 'evil.example:8000' is not a name of this "
                        b"server (a page of another site may be reaching it); if it is one, "
                        b"allow it with --allow-host NAME (--dashboard-allow-host with "
                        b"--dashboard)\n")
        assert headers["content-type"].startswith("text/plain")
        assert _get(base, path, "localhost:8000")[0] in (200, 404), path
    port = base.rsplit(":", 1)[1]
    assert _get(base, "/api/snapshot", f"[::1]:{port}")[0] == 200
    # What the Host says is shown escaped (the answer is plain text anyway).
    status, body, _ = _get(base, "/", "<script>x</script>\u00e9")
    assert status == 403 and b"<script>" in body and b"\\xe9" in body


def test_every_answer_carries_the_browser_side_guards(serve, run):
    base = serve([run])
    for path in ("/", "/api/snapshot", "/nowhere"):
        headers = _get(base, path, None)[2]
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["x-frame-options"] == "DENY" and headers["referrer-policy"] == "no-referrer"
        assert "frame-ancestors 'none'" in headers["content-security-policy"]


def test_allowed_names_reach_the_server(serve, run):
    base = serve([run], hosts=HostRule("127.0.0.1", allowed=("dash.example.org",)))
    assert _get(base, "/api/snapshot", "dash.example.org")[0] == 200
    assert _get(base, "/api/snapshot", "evil.example")[0] == 403
    base = serve([run], hosts=HostRule("127.0.0.1", any_host=True))
    assert _get(base, "/api/snapshot", "evil.example")[0] == 200


def test_the_cli_flags(run):
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "dashboard", str(run), "--port",
                             "0", "--allow-host", "dash.example.org"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = proc.stdout.readline().split(" at ")[1].split()[0].rstrip("/")
        assert _get(base, "/api/snapshot", "dash.example.org:80")[0] == 200
        assert _get(base, "/api/snapshot", "evil.example")[0] == 403
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    out = subprocess.run([sys.executable, "-m", "shoal", "dashboard", str(run),
                          "--allow-host", "http://x/"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr == ("shoal dashboard: error: --allow-host: 'http://x/' is no host name "
                          "or address (give one without a scheme or path)\n")
