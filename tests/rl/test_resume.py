"""PPO resumes exactly: a rank SIGKILLed mid-rollout and the job restarted (--max-restarts)
ends bit for bit where an uninterrupted run ends; resumed at another world size, the
global batch stays and the run says what starts afresh."""

from __future__ import annotations

import json

from shoal.checkpoint import CheckpointStore
from tests.helpers import run_shoal, states_equal

ENV = "tests.rl.envs:KillCartPole-v1"
# 2 ranks x 2 environments x 16 steps = 64 steps an update; 8 updates; a checkpoint every 2.
SETTINGS = ["rl.num_steps=16", "rl.num_envs=2", "rl.total_steps=512", "rl.update_epochs=2",
            "rl.num_minibatches=2", "rl.checkpoint_every=2", "rl.log_every=1", "rl.hidden=16"]


def _final(directory):
    store = CheckpointStore(directory)
    path = store.latest()
    shared, own, meta = store.load(path)
    return path.name, shared, own, meta


def test_sigkill_mid_rollout_resumes_bit_exactly(tmp_path):
    straight = tmp_path / "straight"
    out = run_shoal("train", "--config", "examples/cartpole.yaml", "--nproc-per-node", "2",
                    f"rl.env={ENV}", f"run.dir={straight}",
                    f"rl.checkpoint_dir={straight / 'ckpt'}", "rl.eval_every=null",
                    "rl.target_return=null", *SETTINGS, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    # Metrics of the straight run: every update, episodes, rollout/learn split.
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert steps[-1]["env_steps"] == 512 and steps[-1]["samples_per_s"] > 0
    assert any(r["episode_return"] for r in steps)
    assert {"data", "compute", "comm"} <= set(steps[0]["phases_s"])
    assert "rollout" in out.stdout + out.stderr and "learn" in out.stdout + out.stderr
    result = json.loads((straight / "metrics.json").read_text())
    assert result["env_steps"] == 512 and result["eval_return"] > 0

    # Rank 1 dies inside update 7's rollout (its 101st step); the last checkpoint is update 6.
    killed = tmp_path / "killed"
    out = run_shoal("rl", "--env", ENV, "--nproc-per-node", "2", "--max-restarts", "1",
                    f"run.dir={killed}", f"checkpoint_dir={killed / 'ckpt'}",
                    *[s.removeprefix("rl.") for s in SETTINGS],
                    env={"SHOAL_TEST_KILL": "1:101"}, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    # No resume setting: with restarts and a checkpoint directory, resume=auto is implied.
    assert "rl.resume=auto implied" in out.stderr
    assert "resumed from" in out.stderr and "update 6" in out.stderr and "exactly" in out.stderr
    name_a, shared_a, own_a, meta_a = _final(straight / "ckpt")
    name_b, shared_b, own_b, meta_b = _final(killed / "ckpt")
    assert name_a == name_b == "step_000000008"
    assert states_equal(shared_a, shared_b)
    assert states_equal(own_a, own_b)  # rank 0's random streams, environments, episodes
    assert meta_a["env_steps"] == meta_b["env_steps"] == 512

    # The straight run's update-4 checkpoint at 1 process: 4 environments keep the batch.
    again = tmp_path / "again"
    out = run_shoal("rl", "--env", ENV, "--nproc-per-node", "1", f"run.dir={again}",
                    *[s.removeprefix("rl.") for s in SETTINGS if "checkpoint" not in s],
                    f"resume={straight / 'ckpt' / 'step_000000004'}", timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 processes x 4 environments keep the checkpoint's 4 environments" in out.stderr
    assert "start afresh" in out.stderr
    assert "no new checkpoints are written" in out.stderr
    assert json.loads((again / "metrics.json").read_text())["env_steps"] == 512
