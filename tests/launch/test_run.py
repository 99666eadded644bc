"""`shoal run` end to end: environment, module entry, logs, and failures by injection."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from tests.helpers import REPO, processes_with, run_shoal

PLAIN_SCRIPT = textwrap.dedent("""
    # A torchrun-style script: no shoal import, reads the environment itself.
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "GROUP_RANK"]
    print("env", *[os.environ[k] for k in keys], "sum", t.item(), "args", *sys.argv[1:])
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if mode == "sleep":  # every rank past init, then waiting: a job in full swing
        open(f"{__file__}.ready{dist.get_rank()}", "w").close()
        time.sleep(600)
    if dist.get_rank() == 1:
        if mode == "raise":
            raise ValueError("injected failure on rank 1")
        if mode == "exit3":
            sys.exit(3)
        if mode == "kill":
            os.kill(os.getpid(), 9)
    if mode != "ok":
        dist.barrier()   # rank 0 waits in a collective that rank 1 never joins
        time.sleep(600)
    dist.destroy_process_group()
""")


@pytest.fixture
def script(tmp_path):
    # A unique name lets the test find any process of this job in the process table.
    path = tmp_path / f"job_{uuid.uuid4().hex[:10]}.py"
    path.write_text(PLAIN_SCRIPT)
    return path


def test_torchrun_style_script_runs_unmodified(script):
    out = run_shoal("run", "--nproc-per-node", "2", str(script), "ok", "--flag-for-script")
    assert out.returncode == 0, out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if " env " in line)
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        prefix, fields = line.split(" env ")
        assert prefix == f"[rank{rank}]:"
        r, local, world, local_world, addr, port, group = fields.split()[:7]
        assert (r, local, world, local_world, group) == (str(rank), str(rank), "2", "2", "0")
        assert addr == "127.0.0.1" and int(port) > 0
        assert fields.endswith("sum 3.0 args ok --flag-for-script")


def test_module_entry_and_log_dir(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(PLAIN_SCRIPT)
    logs = tmp_path / "logs"
    out = run_shoal("run", "--nproc-per-node", "2", "--log-dir", str(logs), "-m",
                    "mypkg.train", cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        found = [os.path.join(d, "stdout.log") for d, _, files in os.walk(logs)
                 if "stdout.log" in files and os.path.basename(d) == str(rank)]
        assert len(found) == 1
        assert f"env {rank} {rank} 2" in open(found[0]).read()


def test_two_jobs_at_once_pick_their_own_ports(script):
    cmd = [sys.executable, "-m", "shoal", "run", "--nproc-per-node", "2", str(script)]
    jobs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    for job in jobs:
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err


@pytest.mark.parametrize("mode, cause, code", [
    ("raise", "raised ValueError: injected failure on rank 1", 1),
    ("exit3", "exit code 3", 3),
    ("kill", "killed by SIGKILL", 128 + 9),
])
def test_failed_worker_is_named_and_nothing_is_left(script, mode, cause, code):
    out = run_shoal("run", "--nproc-per-node", "2", str(script), mode)
    assert out.returncode == code, out.stderr
    assert f"shoal: rank 1 failed first ({cause}" in out.stderr
    if mode == "raise":
        assert "Traceback of rank 1:" in out.stderr
        assert "ValueError: injected failure on rank 1" in out.stderr
        assert "shoal/launch/worker.py" not in out.stderr.split("Traceback of rank 1:")[1]
    if mode == "kill":  # rank 0 lost its peer: a line says so, without its traceback
        assert "Traceback" not in out.stderr, out.stderr
    if mode == "exit3":  # a rank that chose to exit: where, without a traceback
        assert f"rank 1 called sys.exit at {script}:" in out.stderr
        assert "Traceback of rank 1" not in out.stderr
    assert processes_with(script.name) == []


def test_killing_the_launcher_leaves_no_worker(script):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shoal", "run", "--nproc-per-node", "2", str(script), "sleep"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    ready = [script.with_name(f"{script.name}.ready{r}") for r in (0, 1)]
    deadline = time.time() + 60
    while not all(p.exists() for p in ready) and time.time() < deadline:
        time.sleep(0.2)
    assert all(p.exists() for p in ready), "workers never got past init_process_group"
    assert len(processes_with(script.name)) == 3
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    deadline = time.time() + 15
    while processes_with(script.name) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with(script.name) == []


def test_a_signal_to_the_launcher_ends_it_as_torchrun_under_torchrun_exit_codes(script):
    """torchrun exits 1 when it is stopped by a signal; shoal 128 + the signal, or 1 under
    --torchrun-exit-codes (the workers are stopped either way)."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shoal", "run", "--torchrun-exit-codes", "--nproc-per-node", "2",
         str(script), "sleep"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    ready = [script.with_name(f"{script.name}.ready{r}") for r in (0, 1)]
    deadline = time.time() + 60  # a hang guard
    while not all(p.exists() for p in ready) and time.time() < deadline:
        time.sleep(0.2)
    assert all(p.exists() for p in ready), "workers never got past init_process_group"
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 1, err
    assert "stopped by SIGTERM" in err
    assert processes_with(script.name) == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_launcher_that_is_pid_1_runs_its_workers(script):
    """`shoal run` as the first process of its pid namespace, as in a container started
    without an init (a Kubernetes pod's command): its workers' parent is then pid 1, and
    they run. (Before, each took a parent of pid 1 for a launcher that had died, and
    exited with status 1 at once.)"""
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
                          "shoal", "run", "--nproc-per-node", "2", str(script)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and out.stderr.startswith("unshare:"):
        pytest.skip(f"no pid namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(line.split(" env ")[0] for line in out.stdout.splitlines()
                  if " env " in line) == ["[rank0]:", "[rank1]:"]


def test_two_nodes_with_static_rendezvous_on_loopback(script):
    from shoal.launch.ports import free_port

    port = str(free_port())
    cmd = [sys.executable, "-m", "shoal", "run", "--nnodes", "2", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", port]
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(r), str(script)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outputs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    seen = {}
    for stdout, _ in outputs:
        for line in stdout.splitlines():
            if " env " in line:
                rank, local, world, _, _, _, group = line.split(" env ")[1].split()[:7]
                seen[int(rank)] = (int(local), int(world), int(group))
    # Global ranks 0..3; node r holds ranks 2r and 2r+1 with local ranks 0 and 1.
    assert seen == {0: (0, 4, 0), 1: (1, 4, 0), 2: (0, 4, 1), 3: (1, 4, 1)}
