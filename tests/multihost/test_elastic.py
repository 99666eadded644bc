"""Losing a host: elastic membership carries on without it; a cut link is named and ends
the job."""

import json
import subprocess
import time

import pytest

from tests.multihost.test_multinode import JOB, _env, _local, _shoal

PORT = 29410


def _samples(path, attempt):
    return {int(k): v for k, v in json.loads(
        (path / f"samples_attempt{attempt}.json").read_text()).items()}


def _wait_for(path, hosts, nodes, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
            hosts.close()
            outputs = "\n".join(n.communicate()[0][-3000:] for n in nodes)
            raise AssertionError(f"{path} never appeared:\n{outputs}")
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_survivor_of_a_dead_host_resumes_and_keeps_the_sample_sequence(make_hosts, tmp_path):
    steps = ["--steps", "24", "--every", "4", "--batch-size", "4"]
    reference = tmp_path / "reference"
    reference.mkdir()
    alone = _local("run", "--nproc-per-node", "2", JOB, str(reference), "--no-checkpoints",
                   *steps)
    hosts = make_hosts(2)
    job = tmp_path / "elastic"
    job.mkdir()
    nodes = [hosts.popen(r, _shoal("run", "--nproc-per-node", "1", "--nnodes", "1:2",
                                   "--rdzv-endpoint", f"{hosts.addr(0)}:{PORT}",
                                   "--rdzv-id", "elastic-test", "--rdzv-last-call", "1",
                                   "--max-restarts", "2", "--hang-timeout", "60",
                                   JOB, str(job), *steps, "--step-sleep", "0.25"),
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
             for r in range(2)]
    _wait_for(job / "ready", hosts, nodes)  # 3 steps done on 2 hosts
    # Past the checkpoint of step 4 (its commit marker, written last).
    _wait_for(job / "checkpoints" / "step_000000004" / "COMMIT.json", hosts, nodes)
    hosts.kill_all(1)  # every process of host 1 at once, as a machine that dies
    output = nodes[0].communicate(timeout=200)[0]
    assert nodes[0].returncode == 0, output
    out = alone.communicate(timeout=120)[0]
    assert alone.returncode == 0, out
    assert hosts.pids(1) == []
    # Before the loss: 2 ranks. After: host 0 alone resumed from the last checkpoint,
    # accumulating 2 batches a step, so every step saw the same global samples as a run
    # that never lost a host.
    expected = _samples(reference, 0)
    before, after = _samples(job, 0) if (job / "samples_attempt0.json").exists() else {}, \
        _samples(job, 1)
    assert "accumulating 2" in output, output
    assert min(after) > 4 and max(after) == 24, sorted(after)
    assert after == {s: expected[s] for s in after}
    assert all(before[s] == expected[s] for s in before)


@pytest.mark.timeout(150)
def test_a_host_whose_link_goes_down_is_named_and_nothing_is_left(make_hosts, tmp_path):
    hosts = make_hosts(2)
    hang = 10
    nodes = [hosts.popen(r, _shoal("run", "--nproc-per-node", "1", "--nnodes", "2",
                                   "--node-rank", str(r), "--master-addr", hosts.addr(0),
                                   "--master-port", str(PORT + 1), "--hang-timeout", str(hang),
                                   JOB, str(tmp_path), "--no-checkpoints", "--steps", "10000",
                                   "--step-sleep", "0.05"),
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
             for r in range(2)]
    _wait_for(tmp_path / "ready", hosts, nodes)
    cut = time.monotonic()
    hosts.set_link(1, up=False)
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    took = time.monotonic() - cut
    assert all(node.returncode != 0 for node in nodes), outputs
    assert f"node host1 ({hosts.addr(1)}) has not been heard from" in outputs[0], outputs[0]
    assert "host1" in outputs[1] and "lost the master" in outputs[1], outputs[1]
    assert took < hang + 45, took
    for r in range(2):
        assert hosts.pids(r) == [], f"processes left on host{r}"
