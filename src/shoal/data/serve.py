"""A read-only HTTP server of a dataset's chunks, for nodes that join a job late.

`shoal data replicate` pushes node 0's files over the job's process group, so a node that
joins an elastic job afterwards has nothing. ``serve`` hashes DIR into the same
``Manifest`` once, at start, and answers two requests, nothing else:

    GET /manifest               the manifest, as JSON
    GET /chunk?file=I&index=K   the bytes of chunk K of the manifest's file I

Files are addressed by their position in the manifest, never by a path, so no request
reaches outside DIR; nothing is ever written. The server binds loopback unless told
otherwise, and a non-loopback address needs a token, which every request must then carry
(``Authorization: Bearer TOKEN``). ``shoal.data.fetch`` is the client.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import os
import signal
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from shoal.data.manifest import (
    CHUNK_SIZE,
    FileEntry,
    Manifest,
    ReplicateError,
    build_manifest,
    source_paths,
)

MANIFEST_FORMAT = 1


def manifest_to_json(manifest: Manifest) -> bytes:
    """The manifest as the server sends it."""
    return json.dumps({"format": MANIFEST_FORMAT, **dataclasses.asdict(manifest)}).encode()


def manifest_from_json(data: bytes) -> Manifest:
    """The manifest a server sent; ValueError when it is not one."""
    try:
        raw = json.loads(data)
        if raw.pop("format", None) != MANIFEST_FORMAT:
            raise ValueError(f"not a shoal manifest of format {MANIFEST_FORMAT}")
        files = tuple(FileEntry(**{**f, "chunks": tuple(f["chunks"])}) for f in raw["files"])
        return Manifest(int(raw["chunk_size"]), files, tuple(raw["dirs"]),
                        bool(raw["single_file"]))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a shoal manifest ({exc})") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback name or address (only this machine can reach it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The token given on the command line or in a file (its first line), or None."""
    if token_file is not None:
        try:
            with open(token_file) as f:
                token = f.readline().strip()
        except OSError as exc:
            raise ReplicateError(f"--token-file {token_file}: {exc.strerror}", 2) from None
        if not token:
            raise ReplicateError(f"--token-file {token_file} is empty", 2)
    if token is not None and not token:
        raise ReplicateError("--token is empty", 2)
    return token


class DataServer(ThreadingHTTPServer):
    """Serves one manifest's files from DIR; ``url`` says where."""

    daemon_threads = True  # a client that hangs does not keep the server from stopping

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, chunk_size: int = CHUNK_SIZE):
        if token is None and not is_loopback(host):
            raise ReplicateError(f"--host {host} is not loopback: other machines could read "
                                 "DIR, so give a --token or --token-file", exit_code=2)
        if not os.path.exists(root):
            raise ReplicateError(f"DIR {root} does not exist", exit_code=2)
        # Bind before hashing, so that a taken port shows at once, not after the hashing.
        super().__init__((host, port), _Handler)
        self.root = root
        self.token = token.encode() if token is not None else None
        try:
            self.manifest = build_manifest(root, chunk_size)
        except OSError as exc:
            self.server_close()
            raise ReplicateError(f"cannot read {exc.filename or root}: {exc.strerror}",
                                 exit_code=2) from None
        self.paths = source_paths(self.manifest, root)
        self.manifest_json = manifest_to_json(self.manifest)

    @property
    def url(self) -> str:
        host, port = cast("tuple[str, int]", self.server_address[:2])  # AF_INET(6): a str
        return f"http://{host}:{port}"

    def describe(self) -> str:
        return (f"shoal data serve: serving {self.root} ({len(self.manifest.files)} files, "
                f"{self.manifest.total_bytes / 1e6:.1f} MB) at {self.url}")


class _Handler(BaseHTTPRequestHandler):
    server: DataServer
    server_version = "shoal-data-serve"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line at start is all the server says

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        if not self._authorized():
            self._fail(HTTPStatus.UNAUTHORIZED, "token missing or wrong",
                       {"WWW-Authenticate": "Bearer"})
            return
        url = urlsplit(self.path)
        if url.path == "/manifest":
            self._send(self.server.manifest_json, "application/json")
        elif url.path == "/chunk":
            self._chunk(parse_qs(url.query))
        else:
            self._fail(HTTPStatus.NOT_FOUND, "only /manifest and /chunk are served")

    def _authorized(self) -> bool:
        if self.server.token is None:
            return True
        given = self.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, b"Bearer " + self.server.token)

    def _chunk(self, query: dict[str, list[str]]) -> None:
        manifest = self.server.manifest
        try:
            index, chunk = int(query["file"][0]), int(query["index"][0])
        except (KeyError, ValueError):
            self._fail(HTTPStatus.BAD_REQUEST, "usage: /chunk?file=I&index=K")
            return
        if not (0 <= index < len(manifest.files)
                and 0 <= chunk < len(manifest.files[index].chunks)):
            self._fail(HTTPStatus.NOT_FOUND, f"no chunk {chunk} of file {index}")
            return
        entry, path = manifest.files[index], self.server.paths[index]
        offset, length = entry.chunk_span(chunk, manifest.chunk_size)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != entry.size:
                    self._fail(HTTPStatus.CONFLICT, f"{entry.path} changed since the server "
                               "started; restart it")
                    return
                self._headers(HTTPStatus.OK, "application/octet-stream", length)
                # Straight from the file to the socket; a file cut meanwhile ends the reply
                # short, and the client's sha256 check of the chunk catches any change.
                self.connection.sendfile(f, offset, length)
        except OSError as exc:
            self._fail(HTTPStatus.INTERNAL_SERVER_ERROR, f"{entry.path}: {exc.strerror}")

    def _send(self, body: bytes, content_type: str) -> None:
        self._headers(HTTPStatus.OK, content_type, len(body))
        self.wfile.write(body)

    def _fail(self, status: HTTPStatus, message: str, extra: dict[str, str] | None = None
              ) -> None:
        body = (message + "\n").encode()
        self._headers(status, "text/plain; charset=utf-8", len(body), extra)
        self.wfile.write(body)

    def _headers(self, status: HTTPStatus, content_type: str, length: int,
                 extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()


def serve(root: str, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          chunk_size: int = CHUNK_SIZE) -> int:
    """Serve ``root`` until SIGINT or SIGTERM; the exit status (0, or 2 for bad input)."""
    try:
        server = DataServer(root, host, port, token, chunk_size)
    except ReplicateError as exc:
        print(f"shoal data serve: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except OSError as exc:
        print(f"shoal data serve: error: cannot listen on {host}:{port}: "
              f"{exc.strerror or exc}", file=sys.stderr, flush=True)
        return 2
    print(server.describe(), flush=True)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server_close()
    return 0
