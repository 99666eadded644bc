"""Random metrics lines and random requests against a live dashboard (real HTTP on loopback,
seeded, bounded in count and time): lines of every kind with random values in every field
the dashboard reads, cut or garbled, and requests with random methods, paths, Host and
other headers. No request is answered with a server error, the stream sends only strict
JSON, no error reaches the poller, and afterwards the server still serves a new line."""

from __future__ import annotations

import json
import random
import socket
import string
import time
from typing import Any

from tests.dashboard.conftest import EventStream
from tests.dashboard.hostile import random_line, text
from tests.dashboard.synthetic import event_line, step_line

SEED, CASES, BUDGET_S = 29, 300, 15.0
TOKEN = "fuzz-t0ken"
PAGE_NUMBERS = ("loss", "samples_per_s", "comm_bytes", "tokens_per_s", "mfu", "episode_return")


def _header_text(rng: random.Random, most: int = 30) -> str:
    """Mostly what a header's value may hold; now and then what it may not."""
    return text(rng, most, string.printable if rng.random() < 0.1 else
                 string.ascii_letters + string.digits + string.punctuation + " " + "\u00e9")


def _path(rng: random.Random) -> str:
    piece = rng.choice(["config.yaml", "metrics.jsonl", "x%00", "%00", "..", "%2e%2e",
                        "%2f", "//", "a" * rng.randint(1, 5000), "%ff", "\u00e9", ".",
                        "~", "%", "?", "#", "link", text(rng, 8)])
    files = "/api/runs/0/files/"
    path = rng.choice(["/", "/static/dashboard.js", f"/static/{piece}", "/api/snapshot",
                       "/api/events", f"/api/runs/{rng.choice([0, 1, -1, 2 ** 70])}/files/"
                       f"{piece}", f"/{piece}", files + piece, files + "/".join(
                           rng.choice(["..", "a", "%00", "config.yaml"]) for _ in range(4))]
                      + ["*", piece] * (rng.random() < 0.05))
    if rng.random() < 0.7:
        path += "?token=" + rng.choice([TOKEN] * 5 + ["", "wrong", "%ff", "%00", text(rng)])
    return "".join(c if " " < c < "\x7f" else f"%{ord(c) & 0xff:02x}" for c in path)


def _request(rng: random.Random, port: int) -> bytes:
    method = rng.choice(["GET"] * 24 + ["HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE",
                                       "G\x00T", text(rng, 6).replace(" ", "")])
    hosts = [f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"] * 4 + [
        "evil.example:8000", "", "127.0.0.1.evil.example", "[::1", "localhost:x",
        _header_text(rng, 20)]
    headers = []
    for _ in range(rng.choice([0] + [1] * 18 + [2])):  # none, one, or two Host headers
        headers.append(("Host", rng.choice(hosts)))
    for _ in range(rng.randint(0, 4)):
        headers.append(rng.choice([
            ("Authorization", rng.choice([f"Bearer {TOKEN}", "Bearer ", "bearer x",
                                          _header_text(rng)])),
            ("Range", rng.choice(["bytes=0-3", "bytes=-2", "bytes=5-1", "bytes=x",
                                  "bytes=99999999999999999999-", "bytes=0-1,3-4", ""])),
            ("If-None-Match", _header_text(rng)), ("If-Range", _header_text(rng)),
            ("Accept-Encoding", rng.choice(["gzip", "br", "*", _header_text(rng)])),
            ("Cookie", _header_text(rng)), ("Last-Event-ID", _header_text(rng)),
            (text(rng, 10) or "X", text(rng, 40)) if rng.random() < 0.2 else
            ("X-Text", _header_text(rng)),
            ("X-Bytes", bytes(rng.randrange(128, 256) for _ in range(8)).decode("latin-1")),
        ]))
    body = b""
    if rng.random() < 0.2:
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        headers.append(("Content-Length", str(len(body))))
    head = f"{method} {_path(rng)} HTTP/1.{rng.choice([0, 1, 1])}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers) + "Connection: close\r\n\r\n"
    return head.encode("latin-1", "replace") + body


def _status(port: int, request: bytes) -> int | None:
    """The status of the answer to ``request`` (None: the server closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n" not in answer:
            got = sock.recv(4096)
            if not got:
                break
            answer += got
    if not answer:
        return None
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer[9:12])


def _strict(text: str) -> Any:
    def refuse(constant):
        raise AssertionError(f"{constant} in the stream: no browser can parse it")
    return json.loads(text, parse_constant=refuse)


def _page_can_draw(run: dict) -> None:
    """What the page takes for granted of every record it is sent."""
    for p in run["points"]:
        assert type(p["step"]) is int
        for name in PAGE_NUMBERS:
            assert p.get(name) is None or type(p[name]) in (int, float), (name, p)
        for name in ("rank_step_s", "rank_comm_s"):
            assert p.get(name) is None or all(
                v is None or type(v) in (int, float) for v in p[name]), p
    for w in run["windows"]:
        assert all(type(s) is int for s in w["steps"]) and len(w["steps"]) == 2
        assert all(type(row["rank"]) is int for row in w["ranks"])
    for e in run["events"]:
        assert e.get("kind") is None or isinstance(e["kind"], str)


def test_random_lines_and_requests_against_a_live_dashboard(serve, tmp_path):
    rng = random.Random(SEED)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes((event_line("start", 0) + "\n").encode())
    (tmp_path / "config.yaml").write_text("x: 1\n")
    said: list[str] = []
    base = serve([tmp_path], token=TOKEN, said=said)
    port = int(base.rsplit(":", 1)[1])
    stream = EventStream(base, f"?token={TOKEN}")
    _strict(json.dumps(stream.next()[1]))
    step, deadline, statuses = 0, time.monotonic() + BUDGET_S, {}
    for case in range(CASES):
        if time.monotonic() > deadline:
            break
        if rng.random() < 0.5:
            with open(path, "ab") as f:
                for _ in range(rng.randint(1, 5)):
                    step += 1
                    f.write(random_line(rng, step) + b"\n")
        else:
            request = _request(rng, port)
            status = _status(port, request)
            assert status is None or status < 500, (case, request[:300])
            statuses[status] = statuses.get(status, 0) + 1
    # Still serving: a last good line reaches a new page, and the first page's stream (its
    # every change since the start) was strict JSON all along.
    with open(path, "ab") as f:
        f.write(f"{step_line(10 ** 6)}\n".encode())
    deadline, last = time.monotonic() + 10, None
    while last != 10 ** 6 and time.monotonic() < deadline:
        time.sleep(0.2)
        page = EventStream(base, "", {"Authorization": f"Bearer {TOKEN}"})
        run = _strict(json.dumps(page.next()[1]))["runs"][0]
        page.close()
        last = run["points"][-1]["step"] if run["points"] else None
    assert last == 10 ** 6, "the poller stopped"
    _page_can_draw(run)
    assert run["bad_lines"] > 0 and not [s for s in said if "while reading" in s], said
    stream.response.fp.raw._sock.settimeout(0.5)
    try:
        while True:
            line = stream.response.fp.readline()
            if line.startswith(b"data: "):
                _strict(line[6:].decode())
    except (TimeoutError, OSError):
        pass
    finally:
        stream.close()
    assert {200, 401, 403, 404} <= statuses.keys(), statuses
