"""`shoal doctor` across hosts joined by a real (namespace) network: the pass, and the nodes
it must name when the master's port is firewalled or a host's cable is out."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

PORT = 29500
MISSING = ("shoal doctor: FAIL: node 1: rendezvous: has not reported within {timeout} s "
           "(never reached the master: not started, or its network is down)")


def _doctor(hosts, rank: int, timeout: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shoal", "doctor", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", hosts.addr(0), "--master-port", str(PORT),
            "--timeout", str(timeout), "--size", "4M"]
    # No GPU, even where there is one: the hosts share this machine's GPUs; gloo is tested.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    return hosts.popen(rank, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)


def _both(hosts, timeout: int) -> list[tuple[int, str]]:
    nodes = [_doctor(hosts, r, timeout) for r in range(2)]
    outputs = [node.communicate(timeout=90)[0] for node in nodes]
    return [(node.returncode, out) for node, out in zip(nodes, outputs, strict=True)]


@pytest.mark.timeout(120)
def test_two_hosts_pass_and_name_each_host_its_interface_and_the_bandwidth(make_hosts):
    hosts = make_hosts(2)
    (code0, out0), (code1, out1) = _both(hosts, timeout=20)
    assert (code0, code1) == (0, 0), out0 + out1
    for r, out in enumerate((out0, out1)):
        assert f"node {r} (host{r}, {hosts.addr(r)}): local: PASS: eth0 {hosts.addr(r)} routes " \
            "to the master" in out, out
        # Every node prints node 0's table: one row per host, its name, eth0 and address.
        rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines()
                if re.match(r"[01]  ", line)}
        assert rows == {str(i): [f"host{i}", "eth0", hosts.addr(i)] for i in range(2)}, out
        assert re.search(r"bandwidth   PASS  all-reduce of 4\.0 MB over gloo, 2 nodes: "
                         r"[\d.]+ ms, algbw [\d.]+ GB/s, busbw [\d.]+ GB/s", out), out
        assert out.splitlines()[-1] == "shoal doctor: PASS (2 nodes)"


@pytest.mark.timeout(120)
def test_firewall_on_the_master_port_names_node_1_on_both_nodes(make_hosts):
    hosts = make_hosts(2)
    hosts.block_port(0, PORT)
    (code0, out0), (code1, out1) = _both(hosts, timeout=5)
    assert (code0, code1) == (1, 1), out0 + out1
    assert out1.splitlines()[-1] == (
        f"shoal doctor: FAIL: node 1 (host1): reach: cannot reach the master "
        f"{hosts.addr(0)}:{PORT}: no answer within 5 s (packets dropped: a firewall, or the "
        "wrong --master-addr)")
    assert f"node 1 (host1, {hosts.addr(1)}): reach: FAIL" in out1
    assert out0.splitlines()[-1] == MISSING.format(timeout=5)


@pytest.mark.timeout(120)
def test_a_host_with_its_cable_out_is_named(make_hosts):
    hosts = make_hosts(2)
    hosts.set_link(1, up=False)
    (code0, out0), (code1, out1) = _both(hosts, timeout=6)
    assert (code0, code1) == (1, 1), out0 + out1
    # The reason depends on the kernel (no route to host after ARP gives up, or no answer).
    assert out1.splitlines()[-1].startswith(
        f"shoal doctor: FAIL: node 1 (host1): reach: cannot reach the master "
        f"{hosts.addr(0)}:{PORT}: "), out1
    assert out0.splitlines()[-1] == MISSING.format(timeout=6)
