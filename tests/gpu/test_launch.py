"""The launcher on a one-GPU machine: the hang watch reports a rank that stopped making
progress under NCCL, and a job asking for more NCCL processes than GPUs is refused in one
line before any worker starts, while the same job on gloo is not."""

from __future__ import annotations

import json
import textwrap
import time
import uuid

import pytest
import torch
import yaml

from tests.gpu.common import BACKEND, DEVICE, records
from tests.helpers import processes_with, run_shoal

SCRIPT = textwrap.dedent("""\
    import sys, time, torch, torch.distributed as dist, shoal
    shoal.init(sys.argv[1])
    t = torch.ones(4, device=shoal.device())
    for step in range(3):
        shoal.all_reduce(t)
        shoal.heartbeat(step)
    print(f"on {t.device.type} over {dist.get_backend()}: {t.sum().item():g}", flush=True)
    time.sleep(600)                                           # line 8
""")


def test_hang_watch_reports_a_stalled_nccl_rank(tmp_path):
    script = tmp_path / f"gpu_hang_{uuid.uuid4().hex[:8]}.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    out = run_shoal("run", "--nproc-per-node", "1", "--hang-timeout", "5", str(script),
                    BACKEND, timeout=120)
    assert out.returncode == 124, out.stderr[-2000:]
    assert time.monotonic() - start < 90  # 5 s without a beat, not the 600 s sleep
    # The all-reduces ran on the GPU (a group of one: each leaves the ones as they are).
    assert f"[rank0]: on {DEVICE} over {BACKEND}: 4" in out.stdout, out.stdout[-2000:]
    assert "shoal: hang: no rank made progress for 5 s" in out.stderr, out.stderr[-2000:]
    assert f"rank 0: not in a collective, at {script}:8" in out.stderr, out.stderr[-2000:]
    assert "rank*.stack" in out.stderr
    assert processes_with(script.name) == []


def test_more_nccl_processes_than_gpus_are_refused_in_one_line(tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("needs a machine with exactly one visible GPU")
    run_dir = tmp_path / "digits"
    out = run_shoal("train", "--config", "examples/digits.yaml", "--nproc-per-node", "2",
                    f"run.dir={run_dir}", timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("shoal train: error: "), lines[0]
    for part in ("2 processes", "1 is visible", "--nproc-per-node 1", "trainer.backend: gloo"):
        assert part in lines[0], lines[0]
    assert not run_dir.exists(), "refused after writing the run directory"


def test_the_same_job_on_gloo_is_not_refused(tmp_path):
    run_dir = tmp_path / "digits"
    out = run_shoal("train", "--config", "examples/digits.yaml", "--nproc-per-node", "2",
                    "trainer.backend=gloo", "trainer.max_steps=2", f"run.dir={run_dir}",
                    timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["backend"] == "gloo" and saved["run"]["nproc_per_node"] == 2
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 2
    assert [r["step"] for r in records(run_dir, "step")] == [1, 2]
    assert all(len(r["ranks"]) == 2 for r in records(run_dir, "ranks"))
