"""Dataset replication: manifest, plan and apply on local files; the copy across "nodes"
(gloo processes with a DEST each, and two `shoal data replicate` nodes on loopback)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

import shoal
from shoal.data.manifest import (
    PART_SUFFIX,
    ReplicateError,
    build_manifest,
    copy_chunks,
    finish_file,
    open_part,
    plan_file,
)
from shoal.data.replicate import Node, replicate
from shoal.launch.ports import free_port
from tests.helpers import REPO, run_shoal

CHUNK = 4096


def _tree(root, big_chunks: float = 10.5) -> dict[str, bytes]:
    """A small dataset: nested files, an empty file, an empty folder, one multi-chunk file."""
    files = {
        "a.txt": b"alpha\n",
        "empty.bin": b"",
        "sub/b.bin": os.urandom(3 * CHUNK),
        "sub/deeper/c.bin": os.urandom(100),
        "big.bin": os.urandom(int(big_chunks * CHUNK)),
    }
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(root, "no_files"), exist_ok=True)
    return files


def _digests(root) -> dict[str, str]:
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _apply(manifest, entry_index, target, source):
    """Plan, then copy what the plan needs from ``source``, then finish: one node's work."""
    entry = manifest.files[entry_index]
    plan = plan_file(entry, target, CHUNK, entry_index)
    open_part(plan, entry)
    copy_chunks(manifest, {entry_index: source}, {entry_index: plan.part},
                {(entry_index, c) for c in plan.needed})
    if not plan.done:
        finish_file(plan, entry, CHUNK)
    return plan


def test_manifest_lists_files_chunks_and_folders(tmp_path):
    files = _tree(tmp_path / "src")
    (tmp_path / "src" / "left.bin" f"{PART_SUFFIX}").write_bytes(b"unfinished")
    manifest = build_manifest(str(tmp_path / "src"), CHUNK)
    assert [e.path for e in manifest.files] == ["a.txt", "big.bin", "empty.bin",
                                                 "sub/b.bin", "sub/deeper/c.bin"]
    assert set(manifest.dirs) == {"no_files", "sub", "sub/deeper"}
    big = next(e for e in manifest.files if e.path == "big.bin")
    data = files["big.bin"]
    assert big.size == len(data) and len(big.chunks) == 11
    assert big.sha256 == hashlib.sha256(data).hexdigest()
    assert big.chunks[10] == hashlib.sha256(data[10 * CHUNK:]).hexdigest()
    empty = next(e for e in manifest.files if e.path == "empty.bin")
    assert empty.chunks == () and empty.sha256 == hashlib.sha256(b"").hexdigest()


def test_identical_file_is_skipped(tmp_path):
    _tree(tmp_path / "src")
    shutil.copytree(tmp_path / "src", tmp_path / "dest")
    manifest = build_manifest(str(tmp_path / "src"), CHUNK)
    for index, entry in enumerate(manifest.files):
        plan = plan_file(entry, str(tmp_path / "dest" / entry.path), CHUNK, index)
        assert plan.done and plan.needed == ()


def test_partial_file_resumes_with_only_the_missing_chunks(tmp_path):
    files = _tree(tmp_path / "src")
    manifest = build_manifest(str(tmp_path / "src"), CHUNK)
    index = [e.path for e in manifest.files].index("big.bin")
    target = tmp_path / "dest" / "big.bin"
    target.parent.mkdir()
    # Interrupted after 4 chunks and a half.
    (tmp_path / "dest" / f"big.bin{PART_SUFFIX}").write_bytes(files["big.bin"][:int(4.5 * CHUNK)])
    plan = _apply(manifest, index, str(target), str(tmp_path / "src" / "big.bin"))
    assert plan.needed == tuple(range(4, 11)) and plan.base == plan.part
    assert target.read_bytes() == files["big.bin"]
    assert not os.path.exists(plan.part)


def test_interrupted_part_file_keeps_the_chunks_it_received(tmp_path):
    _tree(tmp_path / "src")
    manifest = build_manifest(str(tmp_path / "src"), CHUNK)
    index = [e.path for e in manifest.files].index("big.bin")
    entry, source = manifest.files[index], str(tmp_path / "src" / "big.bin")
    target = str(tmp_path / "dest" / "big.bin")
    plan = plan_file(entry, target, CHUNK, index)
    open_part(plan, entry)  # full size already: its space is reserved
    assert os.path.getsize(plan.part) == entry.size
    copy_chunks(manifest, {index: source}, {index: plan.part}, {(index, c) for c in (0, 1, 7)})
    # The process dies here; the next run plans again.
    again = plan_file(entry, target, CHUNK, index)
    assert again.needed == (2, 3, 4, 5, 6, 8, 9, 10) and again.base == plan.part


def test_corrupted_chunk_is_the_only_one_sent_again(tmp_path):
    files = _tree(tmp_path / "src")
    shutil.copytree(tmp_path / "src", tmp_path / "dest")
    manifest = build_manifest(str(tmp_path / "src"), CHUNK)
    index = [e.path for e in manifest.files].index("big.bin")
    target = tmp_path / "dest" / "big.bin"
    with open(target, "r+b") as f:
        f.seek(5 * CHUNK + 17)
        f.write(b"\x00garbage\x00")
    plan = _apply(manifest, index, str(target), str(tmp_path / "src" / "big.bin"))
    assert plan.needed == (5,) and plan.base == str(target)
    assert target.read_bytes() == files["big.bin"]


def test_truncated_and_overlong_copies_are_repaired(tmp_path):
    files = _tree(tmp_path / "src")
    shutil.copytree(tmp_path / "src", tmp_path / "dest")
    manifest = build_manifest(str(tmp_path / "src"), CHUNK)
    paths = [e.path for e in manifest.files]
    short = tmp_path / "dest" / "sub" / "b.bin"
    short.write_bytes(files["sub/b.bin"][:CHUNK + 10])
    plan = _apply(manifest, paths.index("sub/b.bin"), str(short),
                  str(tmp_path / "src" / "sub" / "b.bin"))
    assert plan.needed == (1, 2)
    long = tmp_path / "dest" / "big.bin"
    long.write_bytes(files["big.bin"] + b"tail")
    plan = _apply(manifest, paths.index("big.bin"), str(long), str(tmp_path / "src" / "big.bin"))
    assert plan.needed == ()  # every chunk is there; the copy is only cut to size
    assert _digests(tmp_path / "dest") == _digests(tmp_path / "src")


def test_a_wrong_file_is_never_renamed_into_place(tmp_path):
    _tree(tmp_path / "src")
    manifest = build_manifest(str(tmp_path / "src"), CHUNK)
    entry = manifest.files[0]
    target = tmp_path / "dest" / entry.path
    target.parent.mkdir()
    plan = plan_file(entry, str(target), CHUNK)
    open_part(plan, entry)
    with pytest.raises(ReplicateError) as error:  # no chunk was written into the part file
        finish_file(plan, entry, CHUNK)
    assert entry.path in str(error.value) and entry.sha256 in str(error.value)
    assert not target.exists() and os.path.exists(plan.part)


def test_replicate_alone_copies_then_skips(tmp_path):
    _tree(tmp_path / "src")
    os.chmod(tmp_path / "src" / "a.txt", 0o444)
    first = replicate(str(tmp_path / "src"), str(tmp_path / "dest"), chunk_size=CHUNK)
    assert (first.files, first.copied, first.chunks_sent) == (5, 5, 0)
    assert _digests(tmp_path / "dest") == _digests(tmp_path / "src")
    assert (tmp_path / "dest" / "no_files").is_dir()
    assert os.stat(tmp_path / "dest" / "a.txt").st_mode & 0o777 == 0o444
    again = replicate(str(tmp_path / "src"), str(tmp_path / "dest"), chunk_size=CHUNK)
    assert (again.copied, again.skipped, again.nodes[0].up_to_date) == (0, 5, 5)
    assert "0 copied, 5 skipped" in again.describe() and "up to date" in again.describe()
    same = replicate(str(tmp_path / "src"), str(tmp_path / "src"), chunk_size=CHUNK)
    assert same.nodes[0].holds_source and same.copied == 0


def test_single_file_goes_to_a_path_or_into_a_folder(tmp_path):
    (tmp_path / "one.bin").write_bytes(os.urandom(3 * CHUNK + 1))
    (tmp_path / "into").mkdir()
    replicate(str(tmp_path / "one.bin"), str(tmp_path / "copy.bin"), chunk_size=CHUNK)
    replicate(str(tmp_path / "one.bin"), str(tmp_path / "into"), chunk_size=CHUNK)
    data = (tmp_path / "one.bin").read_bytes()
    assert (tmp_path / "copy.bin").read_bytes() == data
    assert (tmp_path / "into" / "one.bin").read_bytes() == data


def test_missing_src_and_unwritable_dest_are_one_line_errors(tmp_path):
    with pytest.raises(ReplicateError, match="SRC .*missing.* does not exist on rank 0") as e:
        replicate(str(tmp_path / "missing"), str(tmp_path / "dest"))
    assert e.value.exit_code == 2
    _tree(tmp_path / "src")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ReplicateError, match=r"not writable on node 0 \(here\): Not a direct"):
        replicate(str(tmp_path / "src"), str(tmp_path / "file" / "dest"),
                  node=Node(0, "here"))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (root only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_is_named(tmp_path, small_disk):
    _tree(tmp_path / "src", big_chunks=40)  # 160 KiB
    with pytest.raises(ReplicateError, match=r"disk full on node 0 \(here\): .*big.bin"):
        replicate(str(tmp_path / "src"), str(small_disk / "dest"), node=Node(0, "here"),
                  chunk_size=CHUNK)


# --- Across processes ---------------------------------------------------------------------


def _replicate_on_rank(src: str, dests: list[str]) -> dict:
    shoal.init("gloo")
    rank = shoal.rank()
    try:
        summary = replicate(src, dests[rank], node=Node(rank, "local"), chunk_size=CHUNK)
    except ReplicateError as exc:
        return {"error": str(exc), "code": exc.exit_code}
    finally:
        shoal.cleanup()
    return {"summary": summary.describe(), "sent": summary.chunks_sent,
            "copied": summary.copied, "mine": summary.nodes[rank].describe()}


def test_three_nodes_get_only_the_chunks_they_lack(tmp_path):
    files = _tree(tmp_path / "src")
    dests = [str(tmp_path / f"node{r}") for r in range(3)]
    shutil.copytree(tmp_path / "src", dests[1])
    with open(os.path.join(dests[1], "big.bin"), "r+b") as f:  # node 1: chunk 2 damaged
        f.seek(2 * CHUNK)
        byte = f.read(1)[0]
        f.seek(2 * CHUNK)
        f.write(bytes([byte ^ 0xFF]))  # a changed byte (b"x" was already there once in 256)
    os.remove(os.path.join(dests[1], "a.txt"))  # and one file missing
    os.makedirs(os.path.join(dests[2]))  # node 2: big.bin interrupted after 6 chunks
    with open(os.path.join(dests[2], f"big.bin{PART_SUFFIX}"), "wb") as f:
        f.write(files["big.bin"][:6 * CHUNK])
    results = shoal.spawn(_replicate_on_rank, nprocs=3, args=(str(tmp_path / "src"), dests))
    # Union of what nodes 1 and 2 lack: big.bin 2 and 6..10, a.txt, and everything else of
    # node 2's (b.bin 3 chunks, c.bin 1; the empty file has no chunk).
    assert [r["sent"] for r in results] == [6 + 1 + 3 + 1] * 3
    assert len({r["summary"] for r in results}) == 1
    assert "5 files" in results[0]["summary"] and "5 copied, 0 skipped" in results[0]["summary"]
    for dest in dests:
        assert _digests(dest) == _digests(tmp_path / "src"), dest
    assert "node 1 (local): wrote 2 files" in results[1]["mine"]
    again = shoal.spawn(_replicate_on_rank, nprocs=3, args=(str(tmp_path / "src"), dests))
    assert again[0]["sent"] == 0 and "0 copied, 5 skipped" in again[0]["summary"]


def test_a_failing_node_stops_every_node_with_the_same_error(tmp_path):
    _tree(tmp_path / "src")
    (tmp_path / "file").write_text("not a folder")
    dests = [str(tmp_path / "node0"), str(tmp_path / "node1"), str(tmp_path / "file" / "x")]
    results = shoal.spawn(_replicate_on_rank, nprocs=3, args=(str(tmp_path / "src"), dests))
    assert len({r["error"] for r in results}) == 1
    assert "not writable on node 2 (local)" in results[0]["error"]
    assert [r["code"] for r in results] == [2, 2, 2]


def test_cli_on_one_node_copies_then_skips(tmp_path):
    _tree(tmp_path / "src")
    out = run_shoal("data", "replicate", str(tmp_path / "src"), str(tmp_path / "dest"))
    assert out.returncode == 0, out.stderr
    assert "5 files" in out.stdout and "5 copied, 0 skipped" in out.stdout
    again = run_shoal("data", "replicate", str(tmp_path / "src"), str(tmp_path / "dest"))
    assert "0 copied, 5 skipped" in again.stdout and "every node was up to date" in again.stdout
    missing = run_shoal("data", "replicate", str(tmp_path / "nope"), str(tmp_path / "dest"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"shoal data replicate: error: SRC {tmp_path / 'nope'} does not exist on rank 0"]


def test_two_nodes_on_loopback(tmp_path):
    files = _tree(tmp_path / "src", big_chunks=(2 << 20) / CHUNK + 0.5)  # 2 MiB + a bit
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "shoal", "data", "replicate", "--nnodes", "2", "--node-rank",
         str(r), "--master-addr", "127.0.0.1", "--master-port", str(port), "--chunk-mb", "1",
         str(tmp_path / "src"), str(tmp_path / f"dest{r}")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    for r in range(2):
        assert _digests(tmp_path / f"dest{r}") == _digests(tmp_path / "src")
    assert (tmp_path / "dest1" / "big.bin").read_bytes() == files["big.bin"]
    # 3 chunks of big.bin (1 MiB, 1 MiB, 2 KiB) and one of each other non-empty file.
    assert "on 2 nodes: 5 copied, 0 skipped; sent 6 chunks" in outputs[0], outputs[0]
    assert "node 1 (" in outputs[1] and "wrote 5 files" in outputs[1]
