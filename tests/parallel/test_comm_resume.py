"""Killed and restarted, a run with compression or weight averaging continues bit for bit:
error feedback, PowerSGD's matrices and random state, the replicas between meetings and
DiLoCo's outer optimizer are all in the checkpoint. (fp16 and bf16 compression keep no
state: they resume as plain DDP does, tested in tests/checkpoint.)"""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint.test_resume import JOB
from tests.helpers import FORKED_FIRST, run_shoal, states_equal

OPTIONS = {
    "powersgd": {"compression": {"name": "powersgd", "warmup_steps": 2}},
    # The resume's first backward is the first compressed step (step 9): it draws the random
    # Qs, in the order of DDP's settled buckets as the run without the kill did.
    "powersgd-from-the-resume": {"compression": {"name": "powersgd", "warmup_steps": 8}},
    "topk": {"compression": {"name": "topk", "ratio": 0.1}},
    "local_sgd": {"strategy": "local_sgd", "local_sgd": {"period": 3}},
    "diloco": {"strategy": "diloco", "diloco": {"period": 3, "outer_dtype": "bf16"}},
}


@pytest.mark.parametrize("option", OPTIONS)
def test_kill_and_resume_is_exact(tmp_path, option):
    settings = json.dumps(OPTIONS[option])
    common = ["--steps", "16", "--every", "4", "--trainer", settings]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    out = run_shoal("run", "--nproc-per-node", "2", JOB, str(straight), "--no-checkpoints",
                    *common, env=FORKED_FIRST)
    assert out.returncode == 0, out.stderr[-3000:]
    # Rank 1 dies after step 10; the restart resumes from step 8, mid-period for the
    # averaging strategies (period 3) and with the compression's state in flight.
    out = run_shoal("run", "--nproc-per-node", "2", "--max-restarts", "1", JOB, str(killed),
                    "--kills", json.dumps([[1, 10, "step"]]), *common, env=FORKED_FIRST)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (killed / "samples_attempt1.json").exists(), "the run was not restarted"
    for rank in range(2):
        a = torch.load(straight / f"final_rank{rank}.pt", weights_only=True)
        b = torch.load(killed / f"final_rank{rank}.pt", weights_only=True)
        for part in ("model", "optimizer", "comm"):
            assert states_equal(a[part], b[part]), (option, rank, part)
    a = torch.load(straight / "final.pt", weights_only=True)
    b = torch.load(killed / "final.pt", weights_only=True)
    assert states_equal(a["rng"], b["rng"])
