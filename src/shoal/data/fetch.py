"""Fetch a dataset from `shoal data serve` into DEST: the pull side of replication.

A node that joins an elastic job after `shoal data replicate` ran has no copy; it runs
``fetch`` before its workers start (`shoal data fetch URL DEST`, or `shoal run --fetch-data
URL DEST`). The copy is planned against the server's manifest with the functions
`shoal data replicate` uses (``shoal.data.manifest``): a file in place is skipped, an
unfinished ``*.shoal-part`` file or a damaged copy keeps its good chunks. Each chunk's sha256
is checked as it arrives (a bad or failed one is asked for again, up to ``retries`` times),
and each whole file's before it is renamed into place.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

from shoal.data.manifest import (
    Manifest,
    ReplicateError,
    beat,
    finish_file,
    prepare_dest,
    write_chunk,
)
from shoal.data.serve import manifest_from_json, read_token

# Waits between tries: 0.5 s, 1 s, 2 s, ... at most this long.
_MAX_BACKOFF_S = 5.0


@dataclass
class FetchReport:
    """What one fetch did to DEST."""

    url: str
    dest: str
    written: int = 0
    """Files written (copied, resumed or repaired)."""
    up_to_date: int = 0
    """Files that were in place already (same size and sha256)."""
    fetched: int = 0
    """Bytes received from the server."""
    kept: int = 0
    """Bytes of chunks kept from an earlier, partial or damaged, copy."""
    seconds: float = 0.0

    def describe(self) -> str:
        return (f"shoal data fetch: wrote {self.written} files to {self.dest} "
                f"({self.fetched / 1e6:.1f} MB fetched from {self.url} in "
                f"{self.seconds:.1f} s, {self.kept / 1e6:.1f} MB kept from an earlier copy); "
                f"{self.up_to_date} already up to date")


class _Retry(Exception):
    """A try that failed in a way another try may not (network, server, bad bytes)."""


class _Client:
    """GET requests to one server, with its token, through no proxy."""

    def __init__(self, url: str, token: str | None, retries: int, timeout: float):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ReplicateError(f"bad URL {url!r}: give http://HOST:PORT of "
                                 "`shoal data serve`", exit_code=2)
        self.url, self.retries, self.timeout = url.rstrip("/"), retries, timeout
        self.headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        # The server is on the job's network: a proxy from the environment must not see it,
        # nor the token.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(self, what: str, check: object = None) -> bytes:
        """The body of ``/what``; ``check(body)`` raises _Retry for a body to ask again."""
        for attempt in range(self.retries + 1):
            try:
                body = self._once(what)
                if callable(check):
                    check(body)
                return body
            except _Retry as exc:
                if attempt == self.retries:
                    raise ReplicateError(f"{exc} (after {attempt + 1} tries)") from None
                time.sleep(min(0.5 * 2 ** attempt, _MAX_BACKOFF_S))
        raise AssertionError("unreachable")

    def _once(self, what: str) -> bytes:
        request = urllib.request.Request(f"{self.url}/{what}", headers=self.headers)
        try:
            with self.opener.open(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            said = exc.read().decode(errors="replace").strip()
            if exc.code == 401:
                raise ReplicateError(f"token refused by {self.url}", exit_code=2) from None
            if exc.code < 500:  # asking again gets the same answer
                raise ReplicateError(f"{self.url} answered {exc.code}: {said}") from None
            raise _Retry(f"{self.url} answered {exc.code}: {said}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            why = getattr(exc, "reason", None) or exc
            raise _Retry(f"cannot reach {self.url}: {why}") from None


def _safe(path: str) -> bool:
    """A manifest path that stays inside DEST (a server is not trusted with ours)."""
    parts = path.split("/")
    return not path.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and "\\" not in path and "\0" not in path


def _get_manifest(client: _Client) -> Manifest:
    def parse(body: bytes) -> Manifest:
        try:
            return manifest_from_json(body)
        except ValueError as exc:
            raise ReplicateError(f"{client.url}/manifest: {exc}") from None

    manifest = parse(client.get("manifest"))
    names = [entry.path for entry in manifest.files] + list(manifest.dirs)
    unsafe = [name for name in names if not _safe(name)]
    if unsafe or manifest.chunk_size < 1 or (manifest.single_file and "/" in names[0]):
        raise ReplicateError(f"{client.url}/manifest names paths outside DEST: {unsafe[:3]}")
    return manifest


def fetch(url: str, dest: str, token: str | None = None, retries: int = 5,
          timeout: float = 60.0) -> FetchReport:
    """Copy what the server at ``url`` serves into ``dest``; raises ReplicateError."""
    client = _Client(url, token, retries, timeout)
    report = FetchReport(client.url, dest)
    manifest = _get_manifest(client)
    started = time.perf_counter()
    try:
        plans = prepare_dest(manifest, dest)
        for plan in plans:
            entry = manifest.files[plan.index]
            if plan.done:
                report.up_to_date += 1
                continue
            for chunk in plan.needed:
                offset, length = entry.chunk_span(chunk, manifest.chunk_size)
                name = f"{entry.path} chunk {chunk}"

                def check(body: bytes, name: str = name, length: int = length,
                          digest: str = entry.chunks[chunk]) -> None:
                    if len(body) != length or hashlib.sha256(body).hexdigest() != digest:
                        raise _Retry(f"{name}: sha256 mismatch ({len(body)} bytes received, "
                                     f"{length} expected)")

                query = urlencode({"file": plan.index, "index": chunk})
                try:
                    body = client.get(f"chunk?{query}", check)
                except ReplicateError as exc:
                    raise ReplicateError(f"{name}: {exc}" if name not in str(exc)
                                         else str(exc), exc.exit_code) from None
                write_chunk(plan.part, offset, memoryview(body))
                report.fetched += length
                beat()
            finish_file(plan, entry, manifest.chunk_size)
            report.written += 1
            report.kept += entry.size - sum(
                entry.chunk_span(c, manifest.chunk_size)[1] for c in plan.needed)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise ReplicateError(f"{where}{exc.strerror or exc}") from None
    report.seconds = time.perf_counter() - started
    return report


def fetch_command(url: str, dest: str, token: str | None = None, token_file: str | None = None,
                  retries: int = 5) -> int:
    """Fetch, then one line: the summary on stdout, or the error on stderr; exit status
    0, 1 (the transfer failed: run again to resume) or 2 (bad input)."""
    try:
        if retries < 0:
            raise ReplicateError(f"--retries must be 0 or more, got {retries}", 2)
        # A trailing slash says "into this directory" for a single file: keep it.
        dest = os.path.abspath(dest) + (os.sep if dest.endswith(os.sep) else "")
        report = fetch(url, dest, read_token(token, token_file), retries)
    except ReplicateError as exc:
        print(f"shoal data fetch: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    print(report.describe(), flush=True)
    return 0
