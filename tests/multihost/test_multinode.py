"""Multi-node training across hosts joined by a real (namespace) network."""

import os
import subprocess
import sys

import torch

from tests.helpers import REPO

JOB = os.path.join(REPO, "tests", "checkpoint", "job.py")
STEPS = 12


def _shoal(*args: str) -> list[str]:
    return [sys.executable, "-m", "shoal", *args]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _local(*args: str) -> subprocess.Popen:
    """``shoal ARGS`` on this machine, started now (it runs beside the hosts' job)."""
    return subprocess.Popen(_shoal(*args), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def test_two_hosts_of_two_match_four_processes_on_one_host(make_hosts, tmp_path):
    hosts = make_hosts(2)
    port = 29400
    for out in ("hosts", "local"):
        (tmp_path / out).mkdir()
    local = _local("run", "--nproc-per-node", "4", JOB, str(tmp_path / "local"),
                   "--no-checkpoints", "--steps", str(STEPS))
    nodes = [hosts.popen(r, _shoal("run", "--nproc-per-node", "2", "--nnodes", "2",
                                   "--node-rank", str(r), "--master-addr", hosts.addr(0),
                                   "--master-port", str(port), "--hang-timeout", "60",
                                   JOB, str(tmp_path / "hosts"), "--no-checkpoints",
                                   "--steps", str(STEPS)),
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
             for r in range(2)]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # Each node names the interface it chose: the namespace's eth0, not loopback.
    for r, out in enumerate(outputs):
        assert f"node {r} reaches the master {hosts.addr(0)} through eth0 ({hosts.addr(r)})" \
            in out, out
    output = local.communicate(timeout=120)[0]
    assert local.returncode == 0, output
    across = torch.load(tmp_path / "hosts" / "final.pt")
    alone = torch.load(tmp_path / "local" / "final.pt")
    for key, value in alone["model"].items():
        assert torch.equal(across["model"][key], value), key
    assert (tmp_path / "hosts" / "samples_attempt0.json").read_text() == \
        (tmp_path / "local" / "samples_attempt0.json").read_text()
