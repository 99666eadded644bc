"""Resume is exact: killed at random steps (once inside a save) and restarted by `shoal run`,
or resumed with another world size, a run continues as if never stopped."""

from __future__ import annotations

import json
import random
import shutil

import torch

from tests.helpers import run_shoal, states_equal

JOB = "tests/checkpoint/job.py"


def _final(path):
    return torch.load(path / "final.pt", weights_only=True)


def test_sigkill_at_random_steps_resumes_bit_exactly(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    out = run_shoal("run", "--nproc-per-node", "2", JOB, str(straight), "--no-checkpoints")
    assert out.returncode == 0, out.stderr
    # Three kills of a random rank at increasing random steps (checkpoints every 4 steps);
    # the second one inside a checkpoint save, after the shards, before the commit.
    rng = random.Random(2026)
    steps = sorted(rng.sample(range(2, 28), 2))
    save_step = rng.choice([s for s in range(4, 28, 4) if s not in steps])
    plan = sorted([[rng.randrange(2), steps[0], "step"], [rng.randrange(2), save_step, "save"],
                   [rng.randrange(2), steps[1], "step"]], key=lambda k: k[1])
    out = run_shoal("run", "--nproc-per-node", "2", "--max-restarts", "3", JOB, str(killed),
                    "--kills", json.dumps(plan), timeout=170)
    assert out.returncode == 0, f"plan {plan}\n{out.stderr[-3000:]}"
    assert (killed / "samples_attempt3.json").exists(), "fewer than 3 restarts happened"
    a, b = _final(straight), _final(killed)
    assert states_equal(a["model"], b["model"]), plan
    assert states_equal(a["optimizer"], b["optimizer"]), plan
    assert states_equal(a["rng"], b["rng"]), plan


def _samples(path, attempt=0):
    return {int(k): v for k, v in json.loads(
        (path / f"samples_attempt{attempt}.json").read_text()).items()}


def test_world_size_change_continues_the_global_sample_sequence(tmp_path):
    # W=2, batch 4, 3 micro-batches a step: global batch 24, 10 steps an epoch.
    common = ["--batch-size", "4", "--every", "6"]
    full = tmp_path / "full"
    full.mkdir()
    out = run_shoal("run", "--nproc-per-node", "2", JOB, str(full), "--steps", "14",
                    "--accumulate", "3", "--no-checkpoints", *common)
    assert out.returncode == 0, out.stderr
    first = tmp_path / "first"
    first.mkdir()
    out = run_shoal("run", "--nproc-per-node", "2", JOB, str(first), "--steps", "6",
                    "--accumulate", "3", *common)
    assert out.returncode == 0, out.stderr
    expected = _samples(full)
    assert _samples(first) == {s: expected[s] for s in range(1, 7)}
    for world in (1, 3):
        resumed = tmp_path / f"w{world}"
        shutil.copytree(first, resumed)
        out = run_shoal("run", "--nproc-per-node", str(world), JOB, str(resumed),
                        "--steps", "14", "--accumulate", "3", *common)
        assert out.returncode == 0, out.stderr
        assert f"accumulating {6 // world}" in out.stderr
        assert _samples(resumed) == {s: expected[s] for s in range(7, 15)}, world
