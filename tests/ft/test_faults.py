"""Live mode through the faults beyond a clean SIGKILL: a frozen group (SIGSTOP), two groups
lost in the same step, the user's lighthouse gone for good."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from shoal.ft import FaultToleranceConfig
from shoal.launch.ports import free_port
from tests.ft.runs import TIMEOUT, final, pids
from tests.ft.test_live import (
    STEPS,
    _equals_ddp,
    _finish,
    _shoal_run,
    ddp_run,  # noqa: F401 (a fixture)
    in_background,
)
from tests.helpers import states_equal

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(300)

# Short enough for a quick test, long enough that a busy machine's step never looks frozen.
FROZEN = ("--hang-timeout", "8", "--ft-step-timeout", "2")


def test_exact_frozen_group_is_killed_by_its_hang_watch_and_heals(tmp_path, ddp_run):  # noqa: F811
    """Group 1 frozen mid-step (SIGSTOP): its own launcher's hang watch finds no beat for
    --hang-timeout, kills it and its agent starts it again; the survivor, beating while it
    waits in the step and the quorum, is never killed; the replacement heals and the run
    ends bitwise equal to today's 2-process DDP run."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--replica-groups", "2", "--max-restarts", "1", *FROZEN,
                                job=("--kill", "1:6:SIGSTOP")))
    assert "rank 0: stopped (SIGSTOP or a debugger), its stack unreadable (last step 6)" \
        in output
    assert pids(live) == [  # group 0 is never restarted
        "pid.g0.a0.r0", "pid.g1.a0.r0", "pid.g1.a1.r0"], output[-6000:]
    assert "replica group 0: step 7 did not commit" in output
    assert "replica group 1: healed from a live group at step 6" in output
    assert _equals_ddp(live, ddp_run())


def test_available_goes_on_without_the_frozen_group(tmp_path):
    """Policy 'available': the survivor gives the frozen group's step up after the step
    timeout and goes on alone; the frozen group is killed by its hang watch, heals and
    rejoins, and both end as one model."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--replica-groups", "2", "--max-restarts", "1",
                                "--ft-policy", "available", "--no-preload", *FROZEN,
                                job=("--kill", "1:6:SIGSTOP", "--pace", "9:0.3")))
    assert pids(live) == ["pid.g0.a0.r0", "pid.g1.a0.r0", "pid.g1.a1.r0"], output[-6000:]
    assert "replica group 0: step 7: 1 of 2 replica groups take part" in output
    assert "all 2 replica groups take part again" in output
    finals = [final(live, group) for group in (0, 1)]
    assert finals[0]["step"] == finals[1]["step"] == STEPS
    assert states_equal(finals[0]["model"], finals[1]["model"])


def test_two_groups_killed_in_one_step_heal_from_the_third(tmp_path):
    """Policy exact, 3 groups: groups 1 and 2 SIGKILLed in the same step; both replacements
    heal from group 0 (and cut their DDP buckets as the others have before their first
    step), and the run ends bitwise equal to the 3-group run without failures."""
    steps = 12
    with in_background(tmp_path / "whole", "--replica-groups", "3", steps=steps) as whole:
        live = tmp_path / "live"
        output = _finish(_shoal_run(live, "--replica-groups", "3", "--max-restarts", "1",
                                    job=("--kill", "1:6", "--kill", "2:6"), steps=steps))
        assert pids(live) == ["pid.g0.a0.r0", "pid.g1.a0.r0", "pid.g1.a1.r0",
                               "pid.g2.a0.r0", "pid.g2.a1.r0"], output[-6000:]
        assert "replica group 0: step 7 did not commit" in output
        for group in (1, 2):
            assert f"replica group {group}: healed from a live group at step 6" in output
        reference = whole()
        for group in range(3):
            ours, theirs = final(live, group), final(reference, group)
            assert ours["step"] == steps
            assert states_equal(ours["model"], theirs["model"])
            assert states_equal(ours["optimizer"], theirs["optimizer"])


def test_the_users_lighthouse_gone_for_good_stops_the_job(tmp_path):
    """A lighthouse given by address dies mid-run and does not come back: each group stops
    after its quorum deadline (its restart cannot join either), the launcher says so once
    per group and falls back to nothing, and the job ends with a failure instead of
    hanging. (A full quorum every step here: a job that nothing fails needs none while its
    steps commit, and would finish without the lighthouse.)"""
    port = free_port("127.0.0.1")
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "shoal.ft.lighthouse", "--bind", f"127.0.0.1:{port}",
         "--min-replicas", "2", "--config", FaultToleranceConfig().model_dump_json()],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    live = tmp_path / "live"
    process = _shoal_run(live, "--replica-groups", "2", "--max-restarts", "1",
                         "--lighthouse", f"http://127.0.0.1:{port}", "--ft-step-timeout", "1",
                         "--ft-replacement-timeout", "4",
                         job=("--hold", "3", "--quorum-every", "0.001"))
    try:
        deadline = time.monotonic() + 200
        while not (live / "held").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                ended = process.poll()
                if ended is None:
                    process.kill()
                raise AssertionError(f"the job ended (exit {ended}) or never held:\n"
                                     + process.communicate(timeout=TIMEOUT)[0].decode()[-4000:])
            time.sleep(0.1)
        os.kill(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()
        (live / "go").write_text("")
        output = process.communicate(timeout=TIMEOUT)[0].decode()
    finally:
        for child in (process, lighthouse):
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait()
    assert process.returncode != 0, output[-4000:]
    for group in (0, 1):
        assert f"replica group {group}: no quorum of the replica groups within 4 s" in output, \
            output[-4000:]
        assert f"replica group {group}: cannot join the replica groups" in output, output[-4000:]
        assert len(re.findall(rf"shoal: replica group {group} stopped \(exit code \d+\): the "
                              rf"lighthouse http://127.0.0.1:{port} does not answer",
                              output)) == 1, output[-4000:]
    assert "falling back" not in output, output[-4000:]
    # Said in a line by the worker (before, with its traceback too): the only tracebacks are
    # the two groups' failure summaries'.
    assert "[group0 rank0]: shoal: replica group 0: no quorum" in output, output[-4000:]
    assert output.count("Traceback (most recent call last)") == 2, output[-6000:]


@pytest.mark.parametrize("policy", ["exact", "available"])
def test_a_group_whose_last_step_did_not_commit_heals_from_the_others(tmp_path, policy):
    """A commit vote is taken inside each group: group 1's last step fails (its vote says
    no) where group 0's commits. Group 1 does the step again, meets group 0 in the quorum
    group 0 holds after its last step, and heals from it, rather than doing the step alone
    after group 0 has ended: both end as one model."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--replica-groups", "2", "--ft-policy", policy,
                                job=("--no-commit", f"1:{STEPS}")))
    assert f"replica group 1: step {STEPS} did not commit" in output
    assert f"replica group 1: healed from a live group at step {STEPS}" in output
    assert pids(live) == [  # no group started again
        "pid.g0.a0.r0", "pid.g1.a0.r0"], output[-6000:]
    finals = [final(live, group) for group in (0, 1)]
    assert finals[0]["step"] == finals[1]["step"] == STEPS
    assert states_equal(finals[0]["model"], finals[1]["model"])
    assert states_equal(finals[0]["optimizer"], finals[1]["optimizer"])


def test_groups_that_do_not_meet_at_the_end_say_so_and_end_as_one_model(tmp_path):
    """Group 0 held after its last step for longer than the step timeout: group 1 waits for
    it at the closing quorum, gives up, and says so in a line (before: 2 s more and not a
    word). (Group 0, going on once group 1 has ended, says so too, unless the lighthouse
    still counts group 1's last request.) Both end at the last step with one model, and the
    job ends well."""
    live = tmp_path / "live"
    run = _shoal_run(live, "--replica-groups", "2", "--ft-step-timeout", "2",
                     job=("--hold", str(STEPS - 1)))  # (the hook runs as step STEPS ends)
    try:
        deadline = time.monotonic() + TIMEOUT  # a hang guard
        while not (live / "held").exists():
            assert run.poll() is None and time.monotonic() < deadline, "never held"
            time.sleep(0.1)
        while not (live / "final.g1.r0.pt").exists():  # group 1 has ended its run
            assert run.poll() is None and time.monotonic() < deadline, "group 1 waits on"
            time.sleep(0.1)
        (live / "go").write_text("")
        output = _finish(run)
    finally:
        run.kill()
    said = [output.count(f"replica group {group}: the replica groups did not meet at the end "
                         "within 2 s") for group in (0, 1)]
    assert said[1] == 1 and said[0] <= 1, output[-4000:]
    finals = [final(live, group) for group in (0, 1)]
    assert finals[0]["step"] == finals[1]["step"] == STEPS
    assert states_equal(finals[0]["model"], finals[1]["model"])


def test_a_group_whose_step_did_not_commit_mid_run_heals_without_waiting(tmp_path, ddp_run):  # noqa: F811
    """Group 1's vote on step 10 says no where group 0's commits. Group 0 goes on without a
    quorum (its step committed with every group in it), so group 1 closes its process group
    across groups: group 0's next all-reduce fails at once, the step does not commit, and
    both meet in the next quorum, where group 1 heals, long before the step timeout (60 s
    here) that group 0 would otherwise wait; the run ends bitwise equal to DDP."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--replica-groups", "2", "--ft-step-timeout", "60",
                                job=("--no-commit", "1:10")))
    assert "replica group 1: step 10 did not commit" in output
    assert "replica group 0: step 11 did not commit" in output
    healed = re.search(r"replica group 1: healed from a live group at step 10 "
                       r"\(\S+ MB in (\S+) s\)", output)
    assert healed and float(healed.group(1)) < 60, output[-4000:]
    assert pids(live) == ["pid.g0.a0.r0", "pid.g1.a0.r0"], output[-6000:]
    assert _equals_ddp(live, ddp_run())
