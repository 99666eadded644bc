"""`shoal doctor` on one machine: the verdict's pieces, then real nodes on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shoal.doctor.checks import DoctorConfig
from shoal.doctor.report import (
    NodeReport,
    Result,
    compare_versions,
    render,
    table,
    verdict_lines,
)
from shoal.errors import UsageError
from shoal.launch.ports import free_port
from tests.helpers import REPO, run_shoal

# The gloo path on every machine: with a GPU, all nodes on this machine would share it.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
VERSIONS = {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None, "nccl": None}


def _report(rank: int, **versions) -> NodeReport:
    return NodeReport(rank, 2, f"host{rank}", "eth0", f"10.0.0.{rank + 1}",
                      {**VERSIONS, **versions})


# -- the pure pieces -------------------------------------------------------------------------


def test_same_versions_pass_once_for_all_nodes():
    results = compare_versions({r: _report(r) for r in range(3)})
    assert [(r.status, r.rank) for r in results] == [("PASS", 0)]
    assert "the same on all 3 nodes" in results[0].detail


def test_a_node_with_other_versions_is_named_with_both_versions():
    reports = {0: _report(0), 1: _report(1), 2: _report(2, torch="2.12.0", cuda="12.4")}
    results = compare_versions(reports)
    assert [(r.status, r.rank) for r in results] == [("FAIL", 2)]
    assert results[0].detail == "torch 2.12.0, cuda 12.4 (node 0: torch 2.13.0+cpu, cuda none)"


def test_verdict_is_one_pass_line_or_one_line_per_failure():
    reports = {0: _report(0), 1: _report(1)}
    passed = [Result("local", 0, "PASS", "ok"), Result("bandwidth", 0, "SKIP", "one node")]
    assert verdict_lines(2, passed, reports) == ["shoal doctor: PASS (2 nodes)"]
    failed = [Result("versions", 1, "FAIL", "torch 2.12.0 (node 0: torch 2.13.0)"),
              Result("rendezvous", 2, "FAIL", "has not reported within 5 s"),
              Result("reach", 1, "FAIL", "cannot reach the master")]
    assert verdict_lines(3, failed, reports) == [
        "shoal doctor: FAIL: node 1 (host1): reach: cannot reach the master",
        "shoal doctor: FAIL: node 1 (host1): versions: torch 2.12.0 (node 0: torch 2.13.0)",
        "shoal doctor: FAIL: node 2: rendezvous: has not reported within 5 s",
    ]


def test_table_keeps_a_row_for_a_node_that_never_reported():
    rows = table(2, {0: _report(0)})
    assert rows[0].split() == ["rank", "hostname", "interface", "address", "python", "torch",
                               "cuda", "nccl", "gpus"]
    assert rows[1].split() == ["0", "host0", "eth0", "10.0.0.1", "3.11.7", "2.13.0+cpu", "-",
                               "-", "0"]
    assert rows[2].split(maxsplit=1) == ["1", "(not reported)"]


def test_render_exit_code_and_report_round_trip():
    report = _report(1)
    report.results.append(Result("reach", 1, "PASS", "10.0.0.1:29500 answered"))
    assert NodeReport.from_json(report.to_json()) == report
    text, code = render(2, "10.0.0.1:29500", [Result("port", 0, "FAIL", "in use")], {})
    assert code == 1 and text.splitlines()[-1] == "shoal doctor: FAIL: node 0: port: in use"


@pytest.mark.parametrize("kwargs, message", [
    ({"nnodes": 2}, "--master-port is required"),
    ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "--node-rank must be in [0, 2)"),
    ({"timeout": 0}, "--timeout must be positive"),
])
def test_bad_topology_is_a_usage_error(kwargs, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace(")", r"\)")):
        DoctorConfig(**kwargs)


def test_bad_flags_exit_2_with_one_line():
    out = run_shoal("doctor", "--size", "lots")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "shoal doctor: error: --size: not a size: 'lots' (e.g. 4K, 256M)"]


# -- real nodes on loopback ------------------------------------------------------------------


def _node(rank: int, port: int, *extra: str, nnodes: int = 2) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shoal", "doctor", "--nnodes", str(nnodes), "--node-rank",
            str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]
    return subprocess.Popen(argv, cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out = proc.communicate(timeout=60)[0]
    return proc.returncode, out


@pytest.mark.timeout(60)
def test_one_node_without_flags_passes():
    out = run_shoal("doctor", timeout=50, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "shoal doctor: PASS (1 node)"
    assert any(line.startswith("bandwidth   SKIP  one node") for line in lines), out.stdout


@pytest.mark.timeout(90)
def test_two_nodes_on_loopback_pass_and_print_the_same_verdict():
    port = free_port()
    nodes = [_node(r, port, "--timeout", "20", "--size", "1M") for r in (1, 0)]
    (code1, out1), (code0, out0) = [_finish(node) for node in nodes]
    assert (code0, code1) == (0, 0), out0 + out1
    for out in (out0, out1):
        assert out.splitlines()[-1] == "shoal doctor: PASS (2 nodes)"
        assert "bandwidth   PASS  all-reduce of 1.0 MB over gloo, 2 nodes" in out
    # Node 1 prints node 0's whole report: the table and the checks.
    assert out0[out0.index("shoal doctor: 2 nodes"):] == out1[out1.index("shoal doctor: 2 nodes"):]


@pytest.mark.timeout(60)
def test_master_port_in_use_fails_naming_node_0_and_the_port():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        code, out = _finish(_node(0, port, "--timeout", "3"))
    assert code == 1, out
    hostname = socket.gethostname()
    assert out.splitlines()[-1] == (f"shoal doctor: FAIL: node 0 ({hostname}): port: port "
                                    f"{port} on 127.0.0.1 is already in use; stop what holds "
                                    "it, or choose another port")


@pytest.mark.timeout(60)
def test_node_1_alone_cannot_reach_the_master():
    port = free_port()
    code, out = _finish(_node(1, port, "--timeout", "3"))
    assert code == 1, out
    last = out.splitlines()[-1]
    assert last.startswith(f"shoal doctor: FAIL: node 1 ({socket.gethostname()}): reach: "
                           f"cannot reach the master 127.0.0.1:{port}: connection refused")


@pytest.mark.timeout(60)
def test_node_0_alone_names_the_node_that_never_reported():
    port = free_port()
    code, out = _finish(_node(0, port, "--timeout", "3"))
    assert code == 1, out
    assert out.splitlines()[-1] == (
        "shoal doctor: FAIL: node 1: rendezvous: has not reported within 3 s (never reached "
        "the master: not started, or its network is down)")
    assert "bandwidth   SKIP  not every node joined" in out


@pytest.mark.timeout(60)
def test_a_node_started_with_other_nnodes_is_named_on_every_node():
    port = free_port()
    nodes = [_node(0, port, "--timeout", "10"), _node(1, port, "--timeout", "10", nnodes=3)]
    (code0, out0), (code1, out1) = [_finish(node) for node in nodes]
    assert (code0, code1) == (1, 1), out0 + out1
    line = (f"shoal doctor: FAIL: node 1 ({socket.gethostname()}): rendezvous: started with "
            "--nnodes 3, node 0 with --nnodes 2")
    assert out0.splitlines()[-1] == line and out1.splitlines()[-1] == line


@pytest.mark.timeout(60)
def test_two_nodes_with_the_same_rank_are_named():
    port = free_port()
    # Node 2 never comes, so node 0 waits out the timeout and both copies of node 1 are in.
    nodes = [_node(r, port, "--timeout", "6", nnodes=3) for r in (0, 1, 1)]
    (code0, out0), *copies = [_finish(node) for node in nodes]
    assert code0 == 1 and [code for code, _ in copies] == [1, 1], out0
    host = socket.gethostname()
    assert out0.splitlines()[-2:] == [
        f"shoal doctor: FAIL: node 1 ({host}): rendezvous: 2 nodes were started with "
        "--node-rank 1; each node needs its own",
        "shoal doctor: FAIL: node 2: rendezvous: has not reported within 6 s (never reached "
        "the master: not started, or its network is down)"]
    lasts = sorted(out.splitlines()[-1] for _, out in copies)
    assert lasts[0].startswith(f"shoal doctor: FAIL: node 1 ({host}): rendezvous: another "
                               "node already reported as node 1"), lasts


@pytest.mark.timeout(60)
def test_a_port_held_by_another_program_does_not_hang_node_1():
    # The port accepts connections and never answers: torch's store client alone would wait
    # forever for the handshake.
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        code, out = _finish(_node(1, port, "--timeout", "3"))
    assert code == 1, out
    assert out.splitlines()[-1].startswith(
        f"shoal doctor: FAIL: node 1 ({socket.gethostname()}): rendezvous: 127.0.0.1:{port} "
        "accepted the connection, but no store answered within"), out
