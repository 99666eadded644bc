"""`shoal data serve` and `shoal data fetch` on loopback: a copy byte for byte, nothing sent
twice, resumed after a kill, repaired after damage; tokens, and nothing outside DIR."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from shoal.cli.main import main
from shoal.data import serve as serve_module
from shoal.data.fetch import fetch
from shoal.data.manifest import PART_SUFFIX, FileEntry, Manifest, ReplicateError
from shoal.data.serve import DataServer, is_loopback, manifest_to_json
from tests.helpers import REPO

MB = 1 << 20
TOKEN = "s3cret-token"


def _dataset(root) -> None:
    files = {"labels.csv": b"id,label\n1,cat\n", "shards/a.bin": os.urandom(3000),
             "shards/deep/b.bin": os.urandom(MB + 17), "empty.bin": b"",
             "big.bin": os.urandom(5 * MB + 123)}  # 6 chunks of 1 MiB
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "empty-dir").mkdir()


def _digests(root) -> dict[str, str]:
    out = {}
    for base, dirs, names in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(base, name), root) + "/"] = "dir"
        for name in names:
            with open(os.path.join(base, name), "rb") as f:
                out[os.path.relpath(os.path.join(base, name), root)] = \
                    hashlib.sha256(f.read()).hexdigest()
    return out


@contextlib.contextmanager
def _serving(root, token: str | None = None):
    server = DataServer(str(root), token=token, chunk_size=MB)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _get(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    _dataset(root)
    return root


@pytest.mark.timeout(20)
def test_fetch_copies_byte_for_byte_and_a_second_fetch_sends_nothing(src, tmp_path, capsys):
    dest = tmp_path / "dest"
    with _serving(src) as server:
        assert server.describe() == (f"shoal data serve: serving {src} (5 files, 6.3 MB) at "
                                     f"{server.url}")
        assert server.url.startswith("http://127.0.0.1:")
        assert main(["data", "fetch", server.url, str(dest)]) == 0
        first = capsys.readouterr().out
        assert _digests(dest) == _digests(src)
        again = fetch(server.url, str(dest))
    assert f"wrote 5 files to {dest} (6.3 MB fetched" in first, first
    assert (again.written, again.fetched, again.up_to_date) == (0, 0, 5)


@pytest.mark.timeout(20)
def test_damaged_and_truncated_copies_are_repaired_chunk_by_chunk(src, tmp_path):
    dest = tmp_path / "dest"
    with _serving(src) as server:
        fetch(server.url, str(dest))
        with open(dest / "big.bin", "r+b") as f:
            f.seek(2 * MB + 5)
            f.write(b"damage")
        with open(dest / "shards/deep/b.bin", "r+b") as f:
            f.truncate(MB // 2)
        report = fetch(server.url, str(dest))
    assert _digests(dest) == _digests(src)
    assert (report.written, report.up_to_date) == (2, 3)
    assert report.fetched == MB + (MB + 17)  # one chunk of big.bin, both of b.bin
    assert not list(dest.rglob("*" + PART_SUFFIX))


@pytest.mark.timeout(20)
def test_a_fetch_cut_off_by_the_server_resumes_from_its_part_file(src, tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    served = []
    chunk = serve_module._Handler._chunk

    def chunk_then_stop(handler, query):
        served.append(query)
        if len(served) > 3:  # the server dies after three chunks
            handler.server.socket.close()
            handler.connection.close()
            return
        chunk(handler, query)

    monkeypatch.setattr(serve_module._Handler, "_chunk", chunk_then_stop)
    with _serving(src) as server, pytest.raises(ReplicateError) as failed:
        fetch(server.url, str(dest), retries=0)
    assert failed.value.exit_code == 1
    assert list(dest.rglob("*" + PART_SUFFIX))
    monkeypatch.setattr(serve_module._Handler, "_chunk", chunk)
    with _serving(src) as server:
        report = fetch(server.url, str(dest))
    assert _digests(dest) == _digests(src)
    assert report.kept > 0 and report.fetched < server.manifest.total_bytes


@pytest.mark.timeout(30)
def test_a_killed_fetch_resumes_keeping_the_chunks_it_had(src, tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    served = []
    chunk = serve_module._Handler._chunk

    def slow_chunk(handler, query):
        served.append(query)
        time.sleep(0.1)
        chunk(handler, query)

    monkeypatch.setattr(serve_module._Handler, "_chunk", slow_chunk)
    with _serving(src) as server:
        proc = subprocess.Popen([sys.executable, "-m", "shoal", "data", "fetch", server.url,
                                 str(dest)], env={**os.environ, "PYTHONPATH": REPO})
        deadline = time.monotonic() + 20
        while len(served) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(served) >= 4 and proc.returncode == -signal.SIGKILL
        report = fetch(server.url, str(dest))
    assert _digests(dest) == _digests(src)
    assert report.kept > 0


@pytest.mark.timeout(20)
def test_a_wrong_or_missing_token_is_refused_in_one_line(src, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with _serving(src, token=TOKEN) as server:
        assert _get(f"{server.url}/manifest") == 401
        assert _get(f"{server.url}/chunk?file=0&index=0", "wrong") == 401
        for flags in ([], ["--token", "wrong"]):
            assert main(["data", "fetch", *flags, server.url, str(tmp_path / "d")]) == 2
            err = capsys.readouterr().err
            assert err == f"shoal data fetch: error: token refused by {server.url}\n"
        assert main(["data", "fetch", "--token-file", str(token_file), server.url,
                     str(tmp_path / "d")]) == 0
    assert _digests(tmp_path / "d") == _digests(src)


@pytest.mark.timeout(20)
def test_a_non_loopback_host_needs_a_token(src, capsys):
    # Refused before anything is bound: no test here listens beyond loopback.
    assert main(["data", "serve", "--host", "198.18.0.1", str(src)]) == 2
    assert capsys.readouterr().err == (
        "shoal data serve: error: --host 198.18.0.1 is not loopback: other machines could "
        "read DIR, so give a --token or --token-file\n")
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost",
                                     "0.0.0.0", "node0")] == [True] * 4 + [False] * 2


@pytest.mark.timeout(20)
def test_only_the_manifests_chunks_are_served(src, tmp_path):
    with _serving(src) as server:
        base = server.url
        assert _get(f"{base}/manifest") == 200
        assert _get(f"{base}/chunk?file=0&index=0") == 200
        small = [e.path for e in server.manifest.files].index("labels.csv")  # one chunk
        for path in ("chunk?file=5&index=0", "chunk?file=-1&index=0",
                     f"chunk?file={small}&index=1", "chunk?file=0&index=6",
                     "big.bin", "../etc/passwd", "chunk/../../etc/passwd", ""):
            assert _get(f"{base}/{path}") == 404, path
        assert _get(f"{base}/chunk?file=../../etc/passwd&index=0") == 400
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as put:
            opener.open(urllib.request.Request(f"{base}/manifest", data=b"x", method="PUT"))
        assert put.value.code == 501
    assert _digests(src) == _digests(tmp_path / "src")  # nothing was written to DIR


@pytest.mark.timeout(20)
def test_a_chunk_that_stays_wrong_fails_naming_the_file_and_chunk(src, tmp_path, capsys):
    with _serving(src) as server:
        with open(src / "big.bin", "r+b") as f:  # changed after the server hashed it
            f.seek(3 * MB)
            f.write(b"changed")
        code = main(["data", "fetch", "--retries", "1", server.url, str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("shoal data fetch: error: big.bin chunk 3: sha256 mismatch") and \
        "(after 2 tries)" in err and err.count("\n") == 1, err


@pytest.mark.timeout(20)
def test_a_manifest_naming_paths_outside_dest_is_refused(src, tmp_path):
    evil = Manifest(MB, (FileEntry("../outside.txt", 1, "0" * 64, ("0" * 64,), 0o644),))
    with _serving(src) as server:
        server.manifest_json = manifest_to_json(evil)
        with pytest.raises(ReplicateError, match="outside DEST"):
            fetch(server.url, str(tmp_path / "dest"))
    assert not (tmp_path / "outside.txt").exists()


@pytest.mark.timeout(20)
def test_bad_input_exits_2(src, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    with _serving(src) as server:
        assert main(["data", "fetch", server.url, str(tmp_path / "a-file" / "d")]) == 2
        assert "is not writable" in capsys.readouterr().err
    assert main(["data", "fetch", "ftp://host/x", str(tmp_path / "d")]) == 2
    assert "bad URL" in capsys.readouterr().err
