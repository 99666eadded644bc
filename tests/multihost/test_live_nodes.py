"""Live mode across hosts: one replica group per host, a lighthouse on host 0, a host lost
mid-run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tests.ft.runs import final
from tests.ft.test_live import JOB, STEPS, _equals_ddp, _finish, _shoal_run
from tests.helpers import states_equal
from tests.multihost.test_multinode import _env

pytest.importorskip("torchft")

PORT = 29420


def _start(hosts, rank: int, out, *flags: str, hostname: str | None = None,
           job: list[str] = ()):
    argv = [sys.executable, "-m", "shoal", "run", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", hosts.addr(0), "--master-port", str(PORT), "--ft-mode", "live",
            "--hang-timeout", "0", *flags, JOB, str(out), str(STEPS), "--step-sleep", "0.2",
            *job]
    if hostname is not None:  # a name no host resolves, as on many clusters
        argv = ["sh", "-c", f'hostname {hostname} && exec "$@"', "sh", *argv]
    return hosts.popen(rank, argv, env=_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)


def _wait_for_step(out, step: int, hosts, nodes, timeout: float = 200.0) -> None:
    """Until host 0's group has done ``step`` steps."""
    deadline = time.monotonic() + timeout
    marker = out / "step.g0"
    while not (marker.exists() and int(marker.read_text()) >= step):
        if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
            hosts.close()
            outputs = "\n".join(n.communicate()[0][-3000:] for n in nodes)
            raise AssertionError(f"the job never reached step {step}:\n{outputs}")
        time.sleep(0.1)


def _kill_host(hosts, i: int) -> None:
    hosts.kill_all(i)  # every process of the host at once, as a machine that dies
    deadline = time.monotonic() + 10
    while hosts.pids(i) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loss", ["killed", "cut off"])
def test_available_host_lost_the_other_goes_on(make_hosts, tmp_path, loss):
    """Host 1 lost mid-run, its launcher, agent and workers SIGKILLed or its cable pulled
    out: host 0's group goes on alone, says so in one line, finishes every step, and its
    launcher exits 0. Host 0's hostname resolves nowhere: the groups reach each other (and
    heal) by the addresses their launchers found."""
    hosts = make_hosts(2)
    out = tmp_path / "live"
    out.mkdir()
    # --ft-step-timeout 5 (default 10): what host 0 sits out when host 1 is cut off; a step
    # across groups takes milliseconds here.
    nodes = [_start(hosts, r, out, "--ft-policy", "available", "--ft-step-timeout", "5",
                    hostname="unresolvable" if r == 0 else None) for r in range(2)]
    _wait_for_step(out, 8, hosts, nodes)
    if loss == "killed":
        _kill_host(hosts, 1)
    else:  # nothing is closed: host 0's all-reduce of the step waits step_timeout_s
        hosts.set_link(1, up=False)
    output = nodes[0].communicate(timeout=300)[0]
    assert nodes[0].returncode == 0, output[-4000:]
    assert f"lighthouse http://{hosts.addr(0)}:{PORT}" in output, output[-4000:]
    assert f"node 0 runs replica group 0 of 2 (1 process each) at {hosts.addr(0)}" in output
    assert "replica group 0: step" in output
    assert "1 of 2 replica groups take part; the missing groups' samples are skipped" \
        in output, output[-4000:]
    assert final(out, 0)["step"] == STEPS
    assert not (out / "final.g1.r0.pt").exists()


@pytest.mark.timeout(400)
def test_two_groups_per_host_hold_one_model_close_to_four_ddp_processes(make_hosts, tmp_path):
    """`--replica-groups 2` on each of 2 hosts: host K runs groups 2K and 2K + 1 of 4; the
    4 groups end with one model, within 1e-6 of a 4-process DDP run without failures (not
    bitwise: 4 gradients are summed in another order than DDP's; measured 4.5e-8)."""
    reference = tmp_path / "ddp"
    ddp = _shoal_run(reference, "--nproc-per-node", "4")
    hosts = make_hosts(2)
    out = tmp_path / "live"
    out.mkdir()
    nodes = [_start(hosts, r, out, "--replica-groups", "2") for r in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "node 1 runs replica groups 2, 3 of 4" in outputs[1], outputs[1]
    _finish(ddp)
    finals = [final(out, group) for group in range(4)]
    assert all(f["step"] == STEPS for f in finals)
    assert all(states_equal(f["model"], finals[0]["model"]) for f in finals)
    alone = final(reference, 0, 0)["model"]
    for key, value in alone.items():
        torch.testing.assert_close(finals[0]["model"][key], value, rtol=0, atol=1e-6)


@pytest.mark.timeout(400)
def test_exact_group_lost_for_good_its_node_stops_and_comes_back(make_hosts, tmp_path):
    """Policy exact, host 1's worker SIGKILLed mid-step with no restart left: no launcher
    can restart every group across hosts, so host 1's launcher stops with one line (no
    fallback); started again, its group heals and the run still ends bitwise equal to DDP."""
    reference = tmp_path / "ddp"
    ddp = _shoal_run(reference, "--nproc-per-node", "2")
    hosts = make_hosts(2)
    out = tmp_path / "live"
    out.mkdir()
    argv = (["--max-restarts", "0"], ["--kill", "1:6"])
    nodes = [_start(hosts, r, out, *argv[0], job=argv[1]) for r in range(2)]
    lost = nodes[1].communicate(timeout=200)[0]
    assert nodes[1].returncode != 0, lost
    assert "replica group 1 failed for good (exit code 137): policy exact needs every group, " \
        "so this node's launcher stops" in lost, lost
    assert "falling back" not in lost
    again = _start(hosts, 1, out, *argv[0], job=argv[1])
    outputs = [nodes[0].communicate(timeout=300)[0], again.communicate(timeout=100)[0]]
    assert [nodes[0].returncode, again.returncode] == [0, 0], outputs
    assert "replica group 1: healed from a live group at step 6" in outputs[1], outputs[1]
    assert not (out / "pid.g0.a1.r0").exists()
    _finish(ddp)
    assert _equals_ddp(out, reference)


@pytest.mark.timeout(500)
def test_exact_host_0_lost_with_the_lighthouse_comes_back_and_equals_ddp(make_hosts, tmp_path):
    """Policy exact: host 0 SIGKILLed mid-run, and with it the lighthouse its launcher ran:
    host 1's group waits in memory, asking for a quorum; `shoal run` started again on host 0
    starts the lighthouse again, its group heals from host 1's, and both end bitwise equal
    to a 2-process DDP run without failures. Host 1's group does the step it was in again,
    once, and the replacement's first step commits. (Before, the new lighthouse's first
    quorum had the id host 1's group held from the old one: that group kept its closed
    process group and failed the step again, and the replacement sat its first step out
    until the step's deadline. Host 1 lost and started again heals the same way:
    test_exact_group_lost_for_good_its_node_stops_and_comes_back.)"""
    reference = tmp_path / "ddp"
    ddp = _shoal_run(reference, "--nproc-per-node", "2")
    hosts = make_hosts(2)
    out = tmp_path / "live"
    out.mkdir()
    nodes = [_start(hosts, r, out) for r in range(2)]
    _wait_for_step(out, 8, hosts, nodes)
    _kill_host(hosts, 0)
    nodes[0].communicate()
    again = _start(hosts, 0, out)
    outputs = [again.communicate(timeout=400)[0], nodes[1].communicate(timeout=100)[0]]
    assert [again.returncode, nodes[1].returncode] == [0, 0], outputs
    assert [output.count("did not commit") for output in outputs] == [0, 1], outputs
    assert "replica group 0: healed from a live group at step" in outputs[0], outputs[0]
    assert not (out / "pid.g1.a1.r0").exists()  # host 1's group was never restarted
    assert all(final(out, group)["step"] == STEPS for group in (0, 1))
    _finish(ddp)
    assert _equals_ddp(out, reference)
