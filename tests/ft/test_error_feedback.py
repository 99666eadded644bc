"""Live mode, policy 'exact', under the compressions whose error feedback each rank keeps
for itself (powersgd, topk): 2 groups of 1 process, a hand-over of the compression state
every 10 steps (the default, with no bound on the hand-overs' share of the run: exactly
then), group 0 (which writes the step metrics and the checkpoints) SIGKILLed three steps
after one. Each run is compared
with the same live run without failures under policy 'available', started beside it (the
policies differ only when a group is missing: this also tests that 'available' runs with
these compressions, and that the groups end as one model)."""

from __future__ import annotations

import pytest

from shoal.checkpoint import CheckpointStore
from tests.ft.runs import (
    Runs,
    final,
    pids,
    replaced_once,
    same_end,
    step_metrics,
    written_before_the_kill,
)
from tests.helpers import states_equal

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(300)

STEPS = 16
COMPRESSIONS = {"topk": "topk",  # from the first step
                "powersgd": '{"name":"powersgd","warmup_steps":2}'}  # from step 3
KILLED = {"topk": 0, "powersgd": 0}  # group 0 writes the metrics and the checkpoints


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with Runs(tmp_path_factory.mktemp("runs"), STEPS) as runs:
        yield runs


@pytest.mark.parametrize("compression", sorted(COMPRESSIONS))
def test_replacement_redoes_its_steps_since_the_hand_over(runs, compression):
    """The survivor is never restarted; the replacement heals from it: the state of the
    hand-over at step 10 with its own group's compression state, redoes steps 11 to 13
    alone with the survivor's kept mean of each, and both end bitwise equal to the run
    without failures (which the error feedback of the killed group's steps 11 to 16 feeds).
    Under topk the group killed is group 0, which writes the step metrics in windows of 8:
    the one of steps 9 to 16 dies with it, and its replacement writes steps 9 and 10 as the
    survivor kept them (with its hand-over), then its own: every step's figures are those
    of the run without failures. Under powersgd it writes a checkpoint every step: those of
    the steps it redoes are complete already, and are not written again."""
    killed = KILLED[compression]
    job = f"--compression {COMPRESSIONS[compression]} --share 1"
    metrics = f" --metrics {runs.root}/{{}}/metrics:8" if compression == "topk" else ""
    runs.start(f"whole-{compression}", "--replica-groups", "2", "--ft-policy", "available",
               job=job + metrics.format(f"whole-{compression}"))
    checkpoints = (f" --checkpoints {runs.root}/killed-powersgd/ckpt"
                   if compression == "powersgd" else "")
    runs.start(f"killed-{compression}", "--replica-groups", "2", "--max-restarts", "1",
               job=f"{job} --kill {killed}:13" + metrics.format(f"killed-{compression}")
               + checkpoints)
    live, output = runs.wait(f"killed-{compression}")
    assert pids(live) == replaced_once(killed), output[-6000:]
    assert f"replica group {killed}: healed from a live group at step 10" in output, \
        output[-6000:]
    assert f"replica group {killed}: redoes steps 11 to 13 alone while the other groups " \
        "wait" in output, output[-6000:]
    reference, _ = runs.wait(f"whole-{compression}")
    assert final(live)["step"] == STEPS
    assert all(same_end(final(live, group), final(reference, group)) for group in (0, 1))
    assert same_end(final(reference, 0), final(reference, 1))
    if metrics:
        steps = step_metrics(live / "metrics")
        assert len(steps) == STEPS and steps == step_metrics(reference / "metrics")
    if checkpoints:  # each written once: steps 1 to 13 before the kill, 14 to 16 after
        assert written_before_the_kill(live, f"{killed}:13", STEPS) == [True] * 13 + [False] * 3
        store = CheckpointStore(live / "ckpt")
        assert states_equal(store.load(store.latest())[0]["model"], final(live)["model"])


def test_a_group_whose_step_did_not_commit_catches_up_from_the_hand_over(runs):
    """Group 1's own vote on step 12 says no while group 0 commits it: group 1 undoes the
    step's error feedback, heals from group 0's hand-over at step 10 (its own compression
    state then) and redoes steps 11 and 12; both end bitwise equal to the run without
    failures."""
    job = f"--compression {COMPRESSIONS['topk']} --share 1"
    runs.start("whole-topk", "--replica-groups", "2", "--ft-policy", "available",
               job=f"{job} --metrics {runs.root}/whole-topk/metrics:8")
    runs.start("no-commit", "--replica-groups", "2", job=f"{job} --no-commit 1:12")
    live, output = runs.wait("no-commit")
    assert "replica group 1: step 12 did not commit" in output
    assert "replica group 1: redoes steps 11 to 12 alone while the other groups wait" in output
    reference, _ = runs.wait("whole-topk")
    assert all(same_end(final(live, group), final(reference, group)) for group in (0, 1))


def test_every_group_lost_at_once_resumes_each_with_its_own_error_feedback(runs):
    """Both groups SIGKILLed in the same step: no live group is left to heal from, and
    both resume from the checkpoint of step 13, which group 0 wrote. Group 1 takes its own
    part of that step (its error feedback, which it kept beside the checkpoint) and both end
    bitwise equal to the run without failures (before, group 1 took group 0's error
    feedback from the checkpoint, and the run ended with other weights)."""
    job = f"--compression {COMPRESSIONS['topk']} --share 1"
    runs.start("whole-topk", "--replica-groups", "2", "--ft-policy", "available",
               job=f"{job} --metrics {runs.root}/whole-topk/metrics:8")
    runs.start("both-lost", "--replica-groups", "2", "--max-restarts", "1",
               job=f"{job} --kill 0:13 --kill 1:13 --checkpoints {runs.root}/both-lost/ckpt")
    live, output = runs.wait("both-lost")
    assert pids(live) == sorted(f"pid.g{g}.a{a}.r0" for g in (0, 1) for a in (0, 1)), \
        output[-6000:]
    assert output.count("resumed from") == 2 and "step_000000013 (step 13" in output, \
        output[-6000:]
    reference, _ = runs.wait("whole-topk")
    assert all(same_end(final(live, group), final(reference, group)) for group in (0, 1))
    assert "kept no part of its own" not in output
    assert (live / "ckpt" / "step_000000013.group1" / "rank0.pt").is_file()


def test_a_group_killed_in_its_final_save_resumes_from_the_finished_run(runs):
    """Group 1 SIGKILLed after the last step, before it keeps its own part of the step's
    checkpoint, once group 0's is whole. Group 0 ends, and group 1's restart takes that
    checkpoint without its own part, the run's end, and trains nothing (before, it took
    step 15's, the newest with every part, and waited for a group that had ended: the job
    fell back to a restart of every group). Both end bitwise equal to the run without
    failures."""
    job = f"--compression {COMPRESSIONS['topk']} --share 1"
    runs.start("whole-topk", "--replica-groups", "2", "--ft-policy", "available",
               job=f"{job} --metrics {runs.root}/whole-topk/metrics:8")
    runs.start("killed-after", "--replica-groups", "2", "--max-restarts", "1",
               "--ft-replacement-timeout", "30",
               job=f"{job} --kill-after 1:{STEPS} --checkpoints {runs.root}/killed-after/ckpt")
    live, output = runs.wait("killed-after")
    assert pids(live) == replaced_once(1), output[-6000:]
    assert f"[group1 rank0]: shoal: the run had finished at step {STEPS}" in output, \
        output[-6000:]
    reference, _ = runs.wait("whole-topk")
    assert all(same_end(final(live, group), final(reference, group)) for group in (0, 1))


def test_a_replacement_whose_first_backward_is_the_first_compressed_step(runs):
    """powersgd with a warm-up of 10 steps, the hand-over at step 10: group 1, SIGKILLed in
    step 14, heals from the hand-over at step 10, and its first backward is step 11, the
    first compressed one, which draws the random Q matrices in the order of a bucket's
    parameters. DDP's first backward in a process has a cut of its own (the parameters in
    their order, not the order their gradients become ready), so the replacement settles its
    buckets first: both groups end bitwise equal to the run without failures (before, the
    replacement drew other Qs, its error feedback went on from them, and the run ended with
    other weights)."""
    job = '--compression {"name":"powersgd","warmup_steps":10} --share 1'
    runs.start("whole-powersgd-10", "--replica-groups", "2", "--ft-policy", "available",
               job=job)
    runs.start("killed-powersgd-10", "--replica-groups", "2", "--max-restarts", "1",
               job=f"{job} --kill 1:13")
    live, output = runs.wait("killed-powersgd-10")
    assert pids(live) == replaced_once(1), output[-6000:]
    assert "replica group 1: redoes steps 11 to 13 alone while the other groups wait" \
        in output, output[-6000:]
    reference, _ = runs.wait("whole-powersgd-10")
    assert all(same_end(final(live, group), final(reference, group)) for group in (0, 1))
