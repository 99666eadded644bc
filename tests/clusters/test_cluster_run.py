"""`shoal run` and `shoal train` under a recorded SLURM or SkyPilot environment, end to end
on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from shoal.launch.ports import free_port
from tests.helpers import REPO, processes_with, run_shoal

JOB_SCRIPT = os.path.join(os.path.dirname(__file__), "cluster_job.py")


def _slurm_task(procid: int, ntasks: int, port: int) -> dict[str, str]:
    """What srun gives task ``procid`` of a one-node step of ``ntasks`` tasks."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": str(ntasks),
        "SLURM_TASKS_PER_NODE": str(ntasks), "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NODEID": "0", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


def _clean_environ() -> dict[str, str]:
    # No launcher variables of the test's own run may leak into the recorded environment.
    drop = ("SLURM_", "OMPI_", "PMI", "PET_", "TORCHELASTIC_", "RANK", "WORLD_SIZE",
            "LOCAL_", "GROUP_", "MASTER_", "JOB_COMPLETION_INDEX", "SHOAL_", "SKYPILOT_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture
def script(tmp_path):
    # A unique name lets the test find any process of this job in the process table.
    path = tmp_path / f"job_{uuid.uuid4().hex[:10]}.py"
    shutil.copy(JOB_SCRIPT, path)
    return path


def _run_tasks(args: list[str], envs: list[dict[str, str]], logs, timeout: float = 120):
    """Start one `shoal ARGS` per environment, as srun would; wait for all, or stop all as
    soon as one fails (its peers would wait for it). Returns the tasks and their output."""
    tasks = []
    for i, env in enumerate(envs):
        with open(logs / f"out{i}", "w") as out, open(logs / f"err{i}", "w") as err:
            tasks.append(subprocess.Popen(
                [sys.executable, "-m", "shoal", *args], cwd=REPO, stdout=out, stderr=err,
                env={**_clean_environ(), "OMP_NUM_THREADS": "1", **env}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(task.poll() is None for task in tasks):
        if any(task.poll() not in (None, 0) for task in tasks):
            break
        time.sleep(0.2)
    for task in tasks:
        if task.poll() is None:
            task.kill()
        task.wait()
    return tasks, [((logs / f"out{i}").read_text(), (logs / f"err{i}").read_text())
                   for i in range(len(tasks))]


def _results(out_dir) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}


def test_srun_with_two_tasks_runs_each_as_a_worker(script, tmp_path):
    port = free_port()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    tasks, outputs = _run_tasks(["run", str(script), str(out_dir)],
                                [_slurm_task(rank, 2, port) for rank in (0, 1)], tmp_path)
    assert [task.returncode for task in tasks] == [0, 0], outputs
    seen = _results(out_dir)
    assert sorted(seen) == [0, 1]
    for rank, task in enumerate(tasks):
        got = seen[rank]
        assert (got["RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (got["LOCAL_WORLD_SIZE"], got["GROUP_RANK"]) == ("2", "0")
        assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert (got["group_size"], got["sum"]) == (2, 3.0)  # one group of both tasks
        assert got["pid"] == task.pid  # the task became the worker: no agent, no child
    assert "SLURM job 4242: 2 processes (1 node x 2) started by the scheduler" in outputs[0][1]
    assert "SLURM job 4242" not in outputs[1][1]  # rank 0 speaks for the job
    assert processes_with(script.name) == []


def test_srun_with_one_task_per_node_starts_the_workers(script, tmp_path):
    env = _slurm_task(0, 1, free_port())
    del env["MASTER_ADDR"]  # the first host of the node list is the master
    out = run_shoal("run", "--nproc-per-node", "2", str(script), str(tmp_path), env=env)
    assert out.returncode == 0, out.stderr
    assert "shoal: SLURM job 4242: 1 node x 2 processes, master localhost:" in out.stderr
    seen = _results(tmp_path)
    assert {rank: (got["LOCAL_RANK"], got["WORLD_SIZE"], got["sum"])
            for rank, got in seen.items()} == {0: ("0", "2", 3.0), 1: ("1", "2", 3.0)}
    assert seen[0]["MASTER_ADDR"] == "localhost"
    assert processes_with(script.name) == []


def test_skypilot_nodes_each_start_their_workers(script, tmp_path):
    """SkyPilot runs the command once per node with the nodes' addresses: two 'nodes' on
    this machine (both addresses loopback), each `shoal run --nproc-per-node 2`, make one
    job of 4 ranks in one group, node 0's address the master."""
    port = free_port()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    envs = [{"SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
             "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "0",
             "MASTER_PORT": str(port)} for node in (0, 1)]
    tasks, outputs = _run_tasks(["run", "--nproc-per-node", "2", str(script), str(out_dir)],
                                envs, tmp_path)
    assert [task.returncode for task in tasks] == [0, 0], outputs
    seen = _results(out_dir)
    assert {rank: (got["GROUP_RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"], got["sum"])
            for rank, got in seen.items()} == {
        rank: (str(rank // 2), str(rank % 2), "4", 10.0) for rank in range(4)}  # (1+2+3+4)
    assert all(got["MASTER_ADDR"] == "127.0.0.1" for got in seen.values())
    assert "shoal: SkyPilot: 2 nodes x 2 processes, master 127.0.0.1:" in outputs[0][1], outputs
    assert processes_with(script.name) == []


def test_node_flags_are_refused_where_the_scheduler_started_every_worker(script, tmp_path):
    out = run_shoal("run", "--nproc-per-node", "2", str(script), str(tmp_path),
                    env=_slurm_task(1, 2, free_port()))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nproc-per-node: SLURM job 4242 started every worker" in lines[0]


def test_train_under_srun_saves_the_config_once(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    args = ["train", "--config", "examples/digits.yaml", f"run.dir={run_dir}",
            "trainer.max_steps=3", "trainer.epochs=1", "trainer.progress=false"]
    tasks, outputs = _run_tasks(args, [_slurm_task(rank, 2, port) for rank in (0, 1)],
                                tmp_path, timeout=150)
    assert [task.returncode for task in tasks] == [0, 0], outputs
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run"]["nproc_per_node"] == 2
    assert "done:" in outputs[0][0] and "done:" not in outputs[1][0]  # rank 0 reports
    assert json.loads((run_dir / "metrics.json").read_text())
