"""What a SLURM user does, on a real SLURM cluster of two test hosts (cluster.py): the script
of `shoal slurm` under sbatch, the time-limit warning and the requeue, `srun -n 4 shoal
train`, a node that dies, and the script under shellcheck. Each trained run is compared bit
for bit with the same run on 4 processes of this machine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, states_equal
from tests.remote.runs import final_state

pytestmark = pytest.mark.slurm

STEPS = 12
RUN = ["data.builder=tests.slurm.slow:build_data", f"trainer.max_steps={STEPS}",
       "trainer.progress=false"]
RUN_DIR = Path("runs/digits")


def _env() -> dict[str, str]:
    """What a job needs from the submitting shell (sbatch passes it on): this Python's shoal
    first on PATH, the repository (tests.slurm.slow) importable, one thread per worker."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    bin_dir = os.path.dirname(sys.executable)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": path,
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _project(directory: Path) -> Path:
    """A user's project directory: examples/digits.yaml in it."""
    (directory / "examples").mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(REPO, "examples", "digits.yaml"), directory / "examples")
    return directory


def _shoal(*args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=cwd, timeout=timeout,
                          env={**os.environ, **_env()}, capture_output=True, text=True)


def _script(directory: Path, *args: str) -> Path:
    """`shoal slurm --config examples/digits.yaml ARGS > job.sbatch`, run in ``directory``."""
    out = _shoal("slurm", "--config", "examples/digits.yaml", *args, *RUN,
                 cwd=_project(directory))
    assert out.returncode == 0, out.stderr
    (directory / "job.sbatch").write_text(out.stdout)
    return directory / "job.sbatch"


@pytest.fixture(scope="module")
def reference(slurm_available, tmp_path_factory):
    """The final model and optimizer of the run on 4 processes of this machine."""
    directory = _project(tmp_path_factory.mktemp("local"))
    out = _shoal("train", "--config", "examples/digits.yaml", "--nproc-per-node", "4", *RUN,
                 f"trainer.checkpoint_dir={RUN_DIR / 'checkpoints'}", cwd=directory)
    assert out.returncode == 0, out.stderr[-3000:]
    state, meta = final_state(directory / RUN_DIR)
    assert meta["global_step"] == STEPS
    return state


def _trained(directory: Path) -> dict:
    state, meta = final_state(directory / RUN_DIR)
    assert meta["global_step"] == STEPS
    return state


def _log(directory: Path, job: str) -> str:
    path = directory / f"shoal-digits-{job}.out"
    return path.read_text() if path.exists() else "(no log)"


def _wait_for_steps(cluster, directory: Path, job: str, lines: int = 2) -> None:
    """Until rank 0 has written ``lines`` lines of metrics: the job is training."""
    metrics = directory / RUN_DIR / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, _log(directory, job))
        assert time.monotonic() < deadline, _log(directory, job)
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_sbatch_on_two_nodes_of_two_equals_four_local_processes(slurm_cluster, reference,
                                                                tmp_path):
    script = _script(tmp_path, "--nodes", "2", "--nproc-per-node", "2")
    job = slurm_cluster.sbatch(script, cwd=tmp_path, env=_env())
    state = slurm_cluster.wait(job)
    log = _log(tmp_path, job)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert state["NodeList"] == "host[0-1]"
    assert f"SLURM job {job}: 2 nodes x 2 processes, master host0:" in log, log
    # Each node's shoal ran on its own host and reached host0 over the (namespace) network.
    for r in range(2):
        assert f"node {r} reaches the master host0 through eth0 " \
            f"({slurm_cluster.hosts.addr(r)})" in log, log
    assert states_equal(_trained(tmp_path), reference)


@pytest.mark.timeout(240)
def test_time_limit_warning_saves_requeues_and_resumes_bitwise(slurm_cluster, reference,
                                                               tmp_path):
    script = _script(tmp_path, "--nodes", "2", "--nproc-per-node", "2", "data.args.delay=0.01")
    job = slurm_cluster.sbatch(script, cwd=tmp_path, env=_env())
    _wait_for_steps(slurm_cluster, tmp_path, job)
    # What --signal=USR1@S does before the time limit, now: SIGUSR1 to every task of the step.
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    state = slurm_cluster.wait(job, timeout=180)
    log = _log(tmp_path, job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), log
    assert f"requeueing job {job}" in log, log
    assert states_equal(_trained(tmp_path), reference)


@pytest.mark.timeout(240)
def test_srun_with_one_task_per_worker_equals_four_local_processes(slurm_cluster, reference,
                                                                   tmp_path):
    _project(tmp_path)
    out = slurm_cluster.run(
        ["srun", "--nodes=2", "--ntasks=4", "--kill-on-bad-exit=1", "shoal", "train",
         "--config", "examples/digits.yaml", *RUN, f"trainer.checkpoint_dir={RUN_DIR / 'checkpoints'}"],
        cwd=tmp_path, env={**slurm_cluster.env, **_env()}, timeout=150, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 processes (2 nodes x 2) started by the scheduler" in out.stderr, out.stderr
    assert states_equal(_trained(tmp_path), reference)


@pytest.mark.timeout(240)
def test_a_node_whose_steps_are_killed_is_named_and_the_job_fails(slurm_cluster, tmp_path):
    script = _script(tmp_path, "--nodes", "2", "--nproc-per-node", "1", "data.args.delay=0.05")
    job = slurm_cluster.sbatch(script, cwd=tmp_path, env=_env())
    _wait_for_steps(slurm_cluster, tmp_path, job)
    hosts = slurm_cluster.hosts
    for pid in hosts.pids(1):  # every process of the job's step on host1, as a node that dies
        try:
            if "shoal" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass
    state = slurm_cluster.wait(job, timeout=120)
    log = _log(tmp_path, job)
    assert state["JobState"] == "FAILED", log
    print(log)
    assert "host1" in log
