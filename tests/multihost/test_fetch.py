"""A node that joins an elastic job late fetches the dataset from `shoal data serve` on host 0
before its workers start (`shoal run --fetch-data`), and its workers read the same bytes."""

import json
import os
import subprocess
import time

import pytest

from tests.multihost.test_multinode import _env, _shoal
from tests.multihost.test_replicate import _digests

RDZV_PORT, SERVE_PORT = 29610, 29611
TOKEN = "join-late-token"

# Each worker hashes the copy it reads; alone, it waits for the node that joins (the agent
# restarts the group then); with two nodes, both compare their hashes and report.
WORKER = '''
import hashlib, json, os, socket, sys, time
import torch.distributed as dist

dest, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
digests = {}
for base, _, names in os.walk(dest):
    for name in names:
        with open(os.path.join(base, name), "rb") as f:
            digests[os.path.relpath(os.path.join(base, name), dest)] = \\
                hashlib.sha256(f.read()).hexdigest()
world = dist.get_world_size()
everyone = [None] * world
dist.all_gather_object(everyone, digests)
record = {"host": socket.gethostname(), "world": world, "digests": digests,
          "all_equal": all(d == digests for d in everyone)}
with open(os.path.join(out, f"{socket.gethostname()}-world{world}.json"), "w") as f:
    json.dump(record, f)
if world == 1:
    time.sleep(90)  # until the node that joins makes the agent restart this group
    sys.exit(1)
dist.destroy_process_group()
'''


def _dataset(root) -> None:
    files = {"labels.csv": b"id,label\n1,cat\n2,dog\n", "shards/part-0.bin": os.urandom(5000),
             "shards/part-1.bin": os.urandom(3 * 2**20 + 11)}  # 4 chunks of 1 MiB
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _wait_for(path, procs, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.1)


def _node(hosts, r, dest, out, script, *extra):
    return hosts.popen(r, _shoal("run", *extra, "--nproc-per-node", "1", "--nnodes", "1:2",
                                 "--rdzv-endpoint", f"{hosts.addr(0)}:{RDZV_PORT}",
                                 "--rdzv-id", "fetch-test", "--rdzv-last-call", "1",
                                 "--hang-timeout", "60", str(script), str(dest), str(out)),
                       env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(120)
def test_a_node_that_joins_late_fetches_the_data_before_its_workers_start(make_hosts,
                                                                           tmp_path):
    hosts = make_hosts(2)
    src, dest, out = tmp_path / "src", tmp_path / "host1-data", tmp_path / "out"
    _dataset(src)
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    url = f"http://{hosts.addr(0)}:{SERVE_PORT}"
    server = hosts.popen(0, _shoal("data", "serve", "--host", hosts.addr(0), "--port",
                                   str(SERVE_PORT), "--token-file", str(token_file),
                                   "--chunk-mb", "1", str(src)),
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    # Host 0 holds the data itself: its workers read SRC.
    first = _node(hosts, 0, src, out, script)
    line = server.stdout.readline()
    assert line == f"shoal data serve: serving {src} (3 files, 3.2 MB) at {url}\n", line
    _wait_for(out / "host0-world1.json", [first, server])
    assert not dest.exists()
    joined = _node(hosts, 1, dest, out, script, "--fetch-data", url, str(dest),
                   "--fetch-token-file", str(token_file))
    outputs = [proc.communicate(timeout=90)[0] for proc in (first, joined)]
    assert [first.returncode, joined.returncode] == [0, 0], outputs
    assert f"shoal data fetch: wrote 3 files to {dest} (3.2 MB fetched from {url}" \
        in outputs[1], outputs[1]
    # The fetch ran before host 1's workers started: they read the whole dataset.
    expected = _digests(src)
    assert _digests(dest) == expected
    for host in ("host0", "host1"):
        record = json.loads((out / f"{host}-world2.json").read_text())
        assert record["digests"] == expected and record["all_equal"], record
    server.terminate()
    assert server.wait(timeout=10) == 0
