"""Resume is exact: killed at random steps (once inside a save) and restarted by `shoal run`,
or resumed with another world size, a run continues as if never stopped."""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers import run_shoal, states_equal

JOB = "tests/checkpoint/job.py"
# A hang guard for one `shoal run` of JOB, several times the idle time (~10 s alone, ~25 s
# with a second run beside it on a loaded machine; a run with 3 restarts ~20 s alone).
RUN_S = 170


def _final(path):
    return torch.load(path / "final.pt", weights_only=True)


@pytest.mark.timeout(RUN_S + 30)  # the two runs go side by side
def test_sigkill_at_random_steps_resumes_bit_exactly(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    # Three kills of a random rank at increasing random steps (checkpoints every 4 steps);
    # the second one inside a checkpoint save, after the shards, before the commit.
    rng = random.Random(2026)
    steps = sorted(rng.sample(range(2, 28), 2))
    save_step = rng.choice([s for s in range(4, 28, 4) if s not in steps])
    plan = sorted([[rng.randrange(2), steps[0], "step"], [rng.randrange(2), save_step, "save"],
                   [rng.randrange(2), steps[1], "step"]], key=lambda k: k[1])
    # The uninterrupted reference runs beside the killed run: they share nothing.
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(run_shoal, "run", "--nproc-per-node", "2", JOB, str(straight),
                                "--no-checkpoints", timeout=RUN_S)
        out = run_shoal("run", "--nproc-per-node", "2", "--max-restarts", "3", JOB,
                        str(killed), "--kills", json.dumps(plan), timeout=RUN_S)
    assert reference.result().returncode == 0, reference.result().stderr
    assert out.returncode == 0, f"plan {plan}\n{out.stderr[-3000:]}"
    assert (killed / "samples_attempt3.json").exists(), "fewer than 3 restarts happened"
    a, b = _final(straight), _final(killed)
    assert states_equal(a["model"], b["model"]), plan
    assert states_equal(a["optimizer"], b["optimizer"]), plan
    assert states_equal(a["rng"], b["rng"]), plan
    assert a["train_loss"] == b["train_loss"], plan  # the whole epoch's, not since the resume


def _samples(path, attempt=0):
    return {int(k): v for k, v in json.loads(
        (path / f"samples_attempt{attempt}.json").read_text()).items()}


@pytest.mark.timeout(2 * RUN_S + 30)  # two rounds of runs side by side
def test_world_size_change_continues_the_global_sample_sequence(tmp_path):
    # W=2, batch 4, 3 micro-batches a step: global batch 24, 10 steps an epoch.
    common = ["--batch-size", "4", "--every", "6"]

    def run(world, folder, *args):
        return run_shoal("run", "--nproc-per-node", str(world), JOB, str(folder), "--steps",
                         *args, "--accumulate", "3", *common, timeout=RUN_S)

    full, first = tmp_path / "full", tmp_path / "first"
    full.mkdir()
    first.mkdir()
    # Runs that share nothing go side by side: the reference beside the first part, then
    # the two resumes (each from its own copy of the first part's checkpoints).
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(run, 2, full, "14", "--no-checkpoints")
        out = run(2, first, "6")
        assert reference.result().returncode == 0, reference.result().stderr
        assert out.returncode == 0, out.stderr
        expected = _samples(full)
        assert _samples(first) == {s: expected[s] for s in range(1, 7)}
        for world in (1, 3):
            shutil.copytree(first, tmp_path / f"w{world}")
        resumes = {world: pool.submit(run, world, tmp_path / f"w{world}", "14")
                   for world in (1, 3)}
        for world, resume in resumes.items():
            out = resume.result()
            assert out.returncode == 0, out.stderr
            assert f"accumulating {6 // world}" in out.stderr
            assert _samples(tmp_path / f"w{world}") == {s: expected[s] for s in range(7, 15)}, \
                world


@pytest.mark.timeout(RUN_S + 30)  # the two runs go side by side
def test_a_resume_on_three_processes_cuts_ddps_buckets_as_the_run_did(tmp_path):
    """On more than two ranks gloo's sum of a bucket depends on where each gradient lies in
    it, and DDP cuts a process's buckets anew after its first backward: a resumed process
    settles them before its first step (before, its first step after the resume summed in
    other chunks, and the run ended a few bits off the one it continued)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    common = ["--steps", "16", "--every", "4"]
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_shoal, "run", "--nproc-per-node", "3", JOB, str(straight),
                                "--no-checkpoints", *common, timeout=RUN_S)
        out = run_shoal("run", "--nproc-per-node", "3", "--max-restarts", "1", JOB,
                        str(killed), "--kills", json.dumps([[1, 10, "step"]]), *common,
                        timeout=RUN_S)
    assert reference.result().returncode == 0, reference.result().stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert (killed / "samples_attempt1.json").exists(), "the run was not restarted"
    a, b = _final(straight), _final(killed)
    assert states_equal(a["model"], b["model"])
    assert states_equal(a["optimizer"], b["optimizer"])
