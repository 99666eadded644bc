"""What a SLURM user does, on a real SLURM cluster of two test hosts (cluster.py): the script
of `shoal slurm` under sbatch, the time-limit warning and the requeue, `srun -n 4 shoal
train`, a node that dies, and the script under shellcheck. Each trained run is compared bit
for bit with the same run on as many processes of this machine.

The interrupted run has 2 workers (2 nodes x 1): with 2 nodes x 2 it resumed mid-way and
ended 6e-8 (a unit in the last place) off the uninterrupted run of 4 (see docs/clusters.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import states_equal
from tests.slurm.runs import CHECKPOINTS, RUN, RUN_DIR, STEPS, job_env, project, shoal, trained

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def reference(local_run):
    """``reference()``: the run on 4 processes of this machine, started now, beside the
    cluster's job (module scope: this file's tests share one test worker, and this run)."""
    local_run.start(4)
    return lambda: local_run(4)


def _script(directory: Path, *args: str) -> Path:
    """`shoal slurm --config examples/digits.yaml ARGS > job.sbatch`, run in ``directory``."""
    out = shoal("slurm", "--config", "examples/digits.yaml", *args, *RUN, cwd=project(directory))
    assert out.returncode == 0, out.stderr
    (directory / "job.sbatch").write_text(out.stdout)
    return directory / "job.sbatch"


def _log(directory: Path, job: str) -> str:
    path = directory / f"shoal-digits-{job}.out"
    return path.read_text() if path.exists() else "(no log)"


def _metrics(directory: Path) -> list[dict]:
    path = directory / RUN_DIR / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_steps(cluster, directory: Path, job: str) -> None:
    """Until rank 0 has written a step's metrics: the job is training."""
    deadline = time.monotonic() + 90
    while not any(line["type"] == "step" for line in _metrics(directory)):
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, _log(directory, job))
        assert time.monotonic() < deadline, _log(directory, job)
        time.sleep(0.1)


def _step_pythons(hosts, host: int, step: str) -> tuple[int, dict[int, int]]:
    """Job step ``step``'s slurmstepd on ``host``, and the Python interpreters (this test's
    own) below it, pid -> parent pid: the step's processes found by what they are, not by a
    name that a user's paths (a venv's) may contain as well."""
    python = os.path.realpath(sys.executable)
    parents, pythons, stepd = {}, set(), None
    for pid in hosts.pids(host):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
            if os.path.realpath(f"/proc/{pid}/exe") == python:
                pythons.add(pid)
            elif Path(f"/proc/{pid}/cmdline").read_bytes().startswith(
                    f"slurmstepd: [{step}]".encode()):
                stepd = pid
        except (FileNotFoundError, ProcessLookupError):
            pass
    assert stepd is not None, f"no slurmstepd of step {step} on host{host}"

    def below_stepd(pid: int) -> bool:
        while pid in parents and pid != stepd:
            pid = parents[pid]
        return pid == stepd
    return stepd, {pid: parents[pid] for pid in pythons if below_stepd(pid)}


@pytest.mark.timeout(240)
def test_sbatch_on_two_nodes_of_two_equals_four_local_processes(slurm_cluster, reference,
                                                                tmp_path):
    script = _script(tmp_path, "--nodes", "2", "--nproc-per-node", "2")
    job = slurm_cluster.sbatch(script, cwd=tmp_path, env=job_env())
    state = slurm_cluster.wait(job)
    log = _log(tmp_path, job)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert state["NodeList"] == "host[0-1]"
    assert f"SLURM job {job}: 2 nodes x 2 processes, master host0:" in log, log
    # Each node's shoal ran on its own host and reached host0 over the (namespace) network.
    for r in range(2):
        assert f"node {r} reaches the master host0 through eth0 " \
            f"({slurm_cluster.hosts.addr(r)})" in log, log
    assert states_equal(trained(tmp_path), reference())


@pytest.mark.timeout(240)
def test_time_limit_warning_saves_requeues_and_resumes_bitwise(slurm_cluster, local_run,
                                                               tmp_path):
    local_run.start(2)  # beside the job
    script = _script(tmp_path, "--nodes", "2", "--nproc-per-node", "1", "data.args.delay=0.02")
    job = slurm_cluster.sbatch(script, cwd=tmp_path, env=job_env())
    _wait_for_steps(slurm_cluster, tmp_path, job)
    # What --signal=USR1@S does before the time limit, now: SIGUSR1 to every task of the step.
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    state = slurm_cluster.wait(job, timeout=180)
    log = _log(tmp_path, job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), log
    assert f"requeueing job {job}" in log, log
    # The requeued job went on from the step the signal stopped it at, not from the start.
    (resumed,) = [line["step"] for line in _metrics(tmp_path) if line.get("kind") == "resume"]
    assert 0 < resumed < STEPS, log
    assert states_equal(trained(tmp_path), local_run(2))


@pytest.mark.timeout(240)
def test_srun_with_one_task_per_worker_equals_four_local_processes(slurm_cluster, reference,
                                                                   tmp_path):
    project(tmp_path)
    out = slurm_cluster.run(
        ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--kill-on-bad-exit=1",
         "shoal", "train",
         "--config", "examples/digits.yaml", *RUN, CHECKPOINTS],
        cwd=tmp_path, env={**slurm_cluster.env, **job_env()}, timeout=150, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 processes (2 nodes x 2) started by the scheduler" in out.stderr, out.stderr
    assert states_equal(trained(tmp_path), reference())


@pytest.mark.timeout(240)
def test_a_node_whose_steps_are_killed_is_named_and_the_job_fails(slurm_cluster, tmp_path):
    script = _script(tmp_path, "--nodes", "2", "--nproc-per-node", "1", "data.args.delay=0.05")
    job = slurm_cluster.sbatch(script, cwd=tmp_path, env=job_env())
    _wait_for_steps(slurm_cluster, tmp_path, job)
    hosts = slurm_cluster.hosts
    stepd, pythons = _step_pythons(hosts, 1, f"{job}.0")
    for pid in pythons:  # the step's processes on host1 at once, as a node whose steps die
        os.kill(pid, signal.SIGKILL)
    # One `shoal train` under slurmstepd, and below it its worker; where the worker was forked
    # from a server, that server and the resource tracker Python starts with one as well.
    assert list(pythons.values()).count(stepd) == 1, pythons
    assert len(pythons) in (2, 4), pythons
    state = slurm_cluster.wait(job, timeout=120)
    log = _log(tmp_path, job)
    # srun's status is its worst task's: 128 + SIGKILL on host1.
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "137:0"), log
    summary = [line for line in log.splitlines() if "failed first" in line]
    assert len(summary) == 1, log
    assert summary[0].startswith("shoal: rank 0 failed first (lost its connection to a failed "
                                 f"rank on node host1 ({hosts.addr(1)}): "), log
    assert "srun: error: host1: task 1: Killed" in log, log


@pytest.mark.parametrize("args", [
    ["--nodes", "2"],
    ["--nodes", "4", "--gpus-per-node", "8", "--cpus-per-task", "32", "--time", "1-00:00:00",
     "--partition", "gpu", "--account", "proj-1", "--job-name", "my.run",
     "trainer.epochs=3", "run.dir=runs/a b", "data.args.seed=1"],
], ids=["defaults", "every-option"])
def test_the_script_passes_shellcheck(tmp_path, args):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck)")
    script = _script(tmp_path, *args)
    out = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, ""), out.stdout
