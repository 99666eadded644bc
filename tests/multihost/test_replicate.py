"""`shoal data replicate` across hosts joined by a real (namespace) network: a 25 MB file
of 2 MB chunks (12 and a half) and a few small ones, copied, skipped on a rerun, and
repaired chunk by chunk."""

import hashlib
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

BIG = 25 * 2**20
CHUNK = 2 * 2**20  # (--chunk-mb)
SMALL = {"labels.csv": b"id,label\n1,cat\n2,dog\n", "shards/part-0.bin": os.urandom(5000),
         "shards/part-1.bin": os.urandom(7000), "shards/meta/info.json": b'{"n": 2}\n'}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _dataset(root) -> None:
    for rel, data in SMALL.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    with open(root / "train.bin", "wb") as f:
        for _ in range(BIG // 2**20):
            f.write(os.urandom(2**20))  # random: no two chunks alike


def _digests(root) -> dict[str, str]:
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            h = hashlib.sha256()
            with open(os.path.join(base, name), "rb") as f:
                while block := f.read(8 * 2**20):
                    h.update(block)
            out[os.path.relpath(os.path.join(base, name), root)] = h.hexdigest()
    return out


def _replicate(hosts, port, src, dests) -> list[subprocess.CompletedProcess]:
    procs = [hosts.popen(r, [sys.executable, "-m", "shoal", "data", "replicate", "--nnodes",
                             str(hosts.n), "--node-rank", str(r), "--master-addr",
                             hosts.addr(0), "--master-port", str(port), "--hang-timeout", "60",
                             "--chunk-mb", str(CHUNK >> 20), str(src), str(dests[r])],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
             for r in range(hosts.n)]
    outs = [proc.communicate(timeout=60)[0] for proc in procs]
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out)
            for proc, out in zip(procs, outs, strict=True)]


def _summary(out: str) -> re.Match:
    found = re.search(r"(\d+) files \(.*\) on 3 nodes: (\d+) copied, (\d+) skipped; "
                      r"sent (\d+) chunks \(([\d.]+) MB\) in ([\d.]+) s \(([\d.]+) MB/s\)", out)
    assert found, out
    return found


@pytest.mark.timeout(150)
def test_three_hosts_copy_skip_and_repair(make_hosts, tmp_path):
    hosts = make_hosts(3)
    src = tmp_path / "src"
    _dataset(src)
    dests = [tmp_path / f"host{r}" for r in range(3)]
    files = len(SMALL) + 1
    chunks = -(-BIG // CHUNK) + len(SMALL)

    first = _replicate(hosts, 29510, src, dests)
    assert [p.returncode for p in first] == [0, 0, 0], [p.stdout for p in first]
    expected = _digests(src)
    for dest in dests:
        assert _digests(dest) == expected, dest
    summary = _summary(first[0].stdout)
    assert summary.group(1, 2, 3, 4) == (str(files), str(files), "0", str(chunks))
    print(f"\n{BIG >> 20} MB across 3 namespace hosts: {summary.group(7)} MB/s "
          f"({summary.group(5)} MB in {summary.group(6)} s)")
    for r in (1, 2):
        assert f"node {r} (host{r}): wrote {files} files" in first[r].stdout, first[r].stdout

    again = _replicate(hosts, 29511, src, dests)
    assert [p.returncode for p in again] == [0, 0, 0], [p.stdout for p in again]
    assert _summary(again[0].stdout).group(2, 3, 4) == ("0", str(files), "0")
    assert "every node was up to date" in again[0].stdout

    # Host 1: 4 KB overwritten inside chunk 6 of the big file. Host 2: a small file cut short.
    with open(dests[1] / "train.bin", "r+b") as f:
        f.seek(6 * CHUNK + 12345)
        f.write(os.urandom(4096))
    os.truncate(dests[2] / "shards" / "part-1.bin", 100)
    repair = _replicate(hosts, 29512, src, dests)
    assert [p.returncode for p in repair] == [0, 0, 0], [p.stdout for p in repair]
    found = _summary(repair[0].stdout)
    assert found.group(2, 4) == ("2", "2")  # two files, one chunk each
    assert float(found.group(5)) == pytest.approx((CHUNK + 7000) / 1e6, abs=0.1)
    for dest in dests:
        assert _digests(dest) == expected, dest
    assert "node 1 (host1): wrote 1 files" in repair[1].stdout, repair[1].stdout


def test_an_unwritable_dest_on_one_host_stops_every_host(make_hosts, tmp_path):
    hosts = make_hosts(3)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    (tmp_path / "file").write_text("not a folder")
    dests = [tmp_path / "host0", tmp_path / "host1", tmp_path / "file" / "dest"]
    runs = _replicate(hosts, 29513, src, dests)
    assert [p.returncode for p in runs] == [2, 2, 2], [p.stdout for p in runs]
    line = (f"shoal data replicate: error: DEST {dests[2]} is not writable on node 2 "
            "(host2): Not a directory")
    for run in runs:
        assert line in run.stdout, run.stdout
