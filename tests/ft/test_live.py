"""Live mode on one machine: replica groups, a lighthouse, a group killed mid-step."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from shoal.checkpoint import CheckpointStore
from shoal.examples.digits import build_data, build_model
from tests.ft.runs import TIMEOUT, figures, final, pids, start_piped, step_metrics
from tests.helpers import states_equal

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(300)

JOB = str(Path(__file__).with_name("live_job.py"))
STEPS = 40
# Policy 'available': the final validation loss is within this fraction of the run without
# failures (measured: 1.7 % after 15 of 40 steps with one group of two missing).
AVAILABLE_TOLERANCE = 0.05


def _shoal_run(out: Path, *flags: str, job: tuple[str, ...] = (),
               steps: int = STEPS) -> subprocess.Popen:
    out.mkdir(parents=True)
    return start_piped([sys.executable, "-m", "shoal", "run", "--hang-timeout", "0", *flags,
                        JOB, str(out), str(steps), *job])


def _finish(process: subprocess.Popen) -> str:
    output = process.communicate(timeout=TIMEOUT)[0].decode()
    assert process.returncode == 0, output[-4000:]
    return output


def _exists(pid: int) -> bool:
    """Whether ``pid`` is running or not yet reaped by its parent."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _equals_ddp(live: Path, reference: Path, groups: int = 2) -> bool:
    """Group g of the live run ends like rank g of the DDP run, model and optimizer."""
    return all(states_equal(final(live, group)["model"], final(reference, 0, group)["model"])
               and states_equal(final(live, group)["optimizer"],
                                final(reference, 0, group)["optimizer"])
               for group in range(groups))


@contextmanager
def in_background(out: Path, *flags: str, steps: int = STEPS, job: tuple[str, ...] = ()
                  ) -> Iterator[Callable[[], Path]]:
    """A run started at once and waited for when first asked (so that it runs beside the
    test's own run); stopped by its pid if the test ends first."""
    process = _shoal_run(out, *flags, job=job, steps=steps)
    done: list[Path] = []

    def wait() -> Path:
        if not done:
            _finish(process)
            done.append(out)
        return out
    try:
        yield wait
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Today's 2-process DDP run without failures (its step metrics in metrics/)."""
    folder = tmp_path_factory.mktemp("ddp")
    with in_background(folder / "run", "--nproc-per-node", "2",
                       job=("--metrics", str(folder / "run" / "metrics"))) as wait:
        yield wait


def test_exact_killed_group_heals_and_run_equals_ddp(tmp_path, ddp_run):
    """The lighthouse SIGKILLed at step 3: the launcher starts it again on the same address.
    Then a group SIGKILLed mid-step: the other one is never restarted and waits in memory,
    the replacement heals from it, the interrupted step is done again, once, and both end
    bitwise equal to today's 2-process DDP run without failures. (Before, the new
    lighthouse's first quorum had the id of the old one's that the survivor held: the
    survivor kept its closed process group, failed the step again, and the replacement
    waited about 50 s to connect to it, then failed its first step too.) Observers on
    every hook and a profiler window change nothing of it."""
    live = tmp_path / "live"
    process = _shoal_run(live, "--replica-groups", "2", "--max-restarts", "1",
                         job=("--hold", "3", "--kill", "1:6", "--observers"))
    first = process.stdout.readline().decode()
    lighthouse = int(re.search(r"\(pid (\d+)\)", first).group(1))
    deadline = time.monotonic() + 200
    while not (live / "held").exists():
        assert process.poll() is None and time.monotonic() < deadline, first
        time.sleep(0.1)
    os.kill(lighthouse, signal.SIGKILL)
    # Go on once the launcher has reaped it (it starts the new one at once; it looks every
    # 0.1 s): the groups meet the new one, or retry until it listens.
    while _exists(lighthouse):
        assert process.poll() is None and time.monotonic() < deadline, first
        time.sleep(0.02)
    (live / "go").write_text("")
    output = first + _finish(process)
    assert f"the lighthouse (pid {lighthouse}) ended with code -9: started again" in output
    assert pids(live) == [  # group 0 is never restarted
        "pid.g0.a0.r0", "pid.g1.a0.r0", "pid.g1.a1.r0"], output[-6000:]
    assert output.count("did not commit") == 1, output[-6000:]
    assert "replica group 0: step 7 did not commit" in output
    assert "replica group 1: healed from a live group at step 6" in output
    # Each group's launcher and workers name their group (before: "shoal: attempt 1 of 2
    # failed: rank 0 ..." and "[rank0]: " in both groups).
    assert "shoal: replica group 1: attempt 1 of 2 failed: rank 0 killed by SIGKILL" in output
    # (torch's own C++ warnings carry "[rank0]:[W..." after the prefix, on some versions)
    assert "[group0 rank0]: " in output and not re.search(r"^\[rank0\]: ", output, re.M)
    assert all(final(live, group)["step"] == STEPS for group in (0, 1))
    assert _equals_ddp(live, ddp_run())
    assert sorted(p.name for p in (live / "profile").iterdir()) == [
        "group0-rank0.pt.trace.json", "group1-rank0.pt.trace.json"]
    # The replacement took the survivor's loss sums with its state: the epoch's figure
    # is DDP's in both groups.
    assert figures(live, 0)["train_loss"] == figures(live, 1)["train_loss"] \
        == figures(ddp_run(), 0)["train_loss"]


def test_without_failures_the_groups_ask_the_lighthouse_once(tmp_path, ddp_run):
    """Every step commits with both groups in it, so each step after the first reuses the
    first quorum (no full quorum is due within the hour the Trainer sets): one quorum per
    group for the whole run, and both end bitwise equal to the 2-process DDP run. Each
    group validates alone, in DDP's batches, and its train_loss covers every group's
    losses (they travel with each step's average): the very figures DDP reports, and so
    are its step metrics (the loss of every group's rank, every group's samples)."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--replica-groups", "2",
                                job=("--quorum-every", "3600",
                                     "--metrics", str(tmp_path / "metrics"))))
    assert [figures(live, group)["quorums"] for group in (0, 1)] == [1, 1], output[-4000:]
    assert "trained apart" not in output
    # Group 0 comes first in the quorum: it would write the checkpoints, group 1 not.
    assert [figures(live, group)["saves"] for group in (0, 1)] == [True, False]
    assert [figures(live, group)["reports"] for group in (0, 1)] == [True, False]
    assert all(final(live, group)["step"] == STEPS for group in (0, 1))
    assert _equals_ddp(live, ddp_run())
    for figure in ("validation", "train_loss"):
        assert figures(live, 0)[figure] == figures(live, 1)[figure] \
            == figures(ddp_run(), 0)[figure], figure
    steps = step_metrics(tmp_path / "metrics")
    assert len(steps) == STEPS and steps == step_metrics(ddp_run() / "metrics")


def _val_loss(model_state: dict) -> float:
    model = build_model(hidden=64)
    model.load_state_dict(model_state)
    _, val = build_data()
    inputs, targets = val.tensors
    with torch.no_grad():
        return F.cross_entropy(model(inputs), targets).item()


def test_available_goes_on_without_the_killed_group(tmp_path, ddp_run):
    """Policy 'available': the survivor goes on alone (never restarted), the skipped samples
    are said and counted in metrics, the replacement heals and rejoins, and the run ends
    within the stated tolerance of the run without failures."""
    live = tmp_path / "live"
    # New processes (--no-preload): a replacement forked from the preloaded server can be
    # back before the survivor's next step, and then no step goes on without it.
    output = _finish(_shoal_run(live, "--replica-groups", "2", "--max-restarts", "1",
                                "--ft-policy", "available", "--no-preload",
                                job=("--kill", "1:6", "--pace", "9:0.3",
                                     "--metrics", str(tmp_path / "metrics"))))
    assert pids(live) == ["pid.g0.a0.r0", "pid.g1.a0.r0", "pid.g1.a1.r0"], output[-6000:]
    assert "replica group 0: step 7: 1 of 2 replica groups take part; the missing groups' " \
        "samples are skipped" in output
    assert "all 2 replica groups take part again" in output
    assert "replica group 1: healed from a live group at step" in output
    events = [json.loads(line) for line in
              (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    changes = [e for e in events if e.get("kind") == "replica_groups"]
    assert changes[0]["taking_part"] == 1 and changes[-1]["taking_part"] == 2
    rejoined = changes[-1]["step"]
    assert changes[-1]["skipped_samples"] == (rejoined - 7) * 16  # 16 samples a step a group
    finals = [final(live, group) for group in (0, 1)]
    assert finals[0]["step"] == finals[1]["step"] == STEPS
    assert states_equal(finals[0]["model"], finals[1]["model"])  # one model again
    ours, reference = _val_loss(finals[0]["model"]), _val_loss(final(ddp_run(), 0)["model"])
    assert abs(ours - reference) <= AVAILABLE_TOLERANCE * reference


def test_available_goes_on_writing_while_group_0_is_missing(tmp_path):
    """Policy 'available', group 0 (which writes the checkpoints and metrics while it takes
    part) SIGKILLed at step 6 with no restart left: group 1 goes on alone and writes both
    from then on. With checkpoints (every step), its last one is at the run's last step and
    holds its final model. With metrics in windows of 4, the window of steps 5 and 6 dies
    with group 0: group 1 writes them as it kept them, then its own, every step once. With
    checkpoints every 0.05 s (steps of at least 0.02 s), group 1 saves some of the steps
    between. Group 1 reports the run's end (its final metrics). (Before, none of these was
    written after group 0 was lost.)"""
    flags = ("--replica-groups", "2", "--max-restarts", "0", "--ft-policy", "available")
    folder = tmp_path / "ckpt"
    written = tmp_path / "written"
    with in_background(written, *flags,
                       job=("--kill", "0:6", "--metrics", f"{written / 'metrics'}:4",
                            "--checkpoints", f"{written / 'ckpt'}:0.05",
                            "--step-sleep", "0.02")) as run:
        live = tmp_path / "live"
        output = _finish(_shoal_run(live, *flags,
                                    job=("--kill", "0:6", "--checkpoints", str(folder))))
        assert "replica group 0 failed for good" in output, output[-4000:]
        assert figures(live, 1)["reports"]  # the run's end lines and metrics.json: group 1's
        store = CheckpointStore(folder, keep_last=1)
        shared, _, meta = store.load(store.latest())
        assert meta["global_step"] == STEPS == final(live, 1)["step"]
        assert states_equal(shared["model"], final(live, 1)["model"])
        steps = step_metrics(run() / "metrics")
        assert [step[0] for step in steps] == list(range(1, STEPS + 1))
        timed = [int(p.name[5:]) for p in (written / "ckpt").glob("step_*")
                 if p.name[5:].isdigit()]
        assert any(6 < step < STEPS for step in timed), sorted(timed)


@pytest.mark.parametrize("killed", [1, 0])
def test_exact_without_a_replacement_falls_back_to_restart(tmp_path, ddp_run, killed):
    """Policy exact, and the killed group has no restart left: one line says the job falls
    back to today's restart; the group waiting for it saves its last step and stops at
    once (the SIGTERM ends its wait at the quorum), every group starts again from that
    checkpoint, and the run still ends bitwise equal to the run without failures. The only
    checkpoint is that save (timed ones every 1000 s): also where the group killed is group
    0, which writes the checkpoints while it takes part (before, group 1 ended on the
    SIGTERM without a save, and the restart began again at step 0)."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--replica-groups", "2", "--max-restarts", "0",
                                job=("--kill", f"{killed}:6",
                                     "--checkpoints", f"{tmp_path / 'ckpt'}:1000")))
    assert output.count("falling back to a restart of every group from the last "
                        "checkpoint (policy exact)") == 1
    assert f"replica group {killed} did not come back (exit code" in output
    assert output.count("shoal: preempted by SIGTERM at step 6: checkpoint saved") == 1
    assert "(step 6, epoch 0" in output, output[-4000:]  # where the restart resumed
    assert _equals_ddp(live, ddp_run())


@pytest.mark.parametrize("case", ["available, group 0 lost", "exact, groups of 2"])
def test_a_signal_saves_once_whichever_group_writes(tmp_path, case):
    """SIGTERM to `shoal run` past step 20: the job saves the step it stops at, once, and
    exits with 143, said in one line.
    - Policy 'available', group 0 SIGKILLed at step 6 with no restart left: group 1, which
      writes the checkpoints now, saves. (Before, a preemption signal was group 0's to act
      on: group 1 ended on it without a save.)
    - Policy 'exact', groups of 2 processes (the signal reaches them at about the same
      time, in a step or at a full quorum): group 0 saves, and group 1, whose writer is
      there, does not save the step again."""
    out = tmp_path / "live"
    folder = tmp_path / "ckpt"
    flags = (("--ft-policy", "available", "--max-restarts", "0") if case.startswith("available")
             else ("--nproc-per-node", "2"))
    kill = ("--kill", "0:6") if case.startswith("available") else ()
    run = _shoal_run(out, "--replica-groups", "2", *flags, steps=2000,
                     job=(*kill, "--checkpoints", f"{folder}:1000", "--step-sleep", "0.02"))
    try:
        deadline = time.monotonic() + TIMEOUT  # a hang guard
        marker = out / "step.g1"
        while not (marker.exists() and int(marker.read_text()) >= 20):
            assert run.poll() is None and time.monotonic() < deadline, \
                "group 1 never got past step 20"
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=TIMEOUT)[0].decode()
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGTERM, output[-4000:]
    stops = re.findall(r"preempted by SIGTERM at step (\d+): checkpoint saved", output)
    assert len(stops) == 1 and 20 <= int(stops[0]) < 2000, output[-4000:]
    store = CheckpointStore(folder, keep_last=1)
    _, _, meta = store.load(store.latest())
    assert meta["global_step"] == int(stops[0])
    assert [p.name for p in folder.iterdir()] == [f"step_{int(stops[0]):09d}"]


def test_a_signal_while_a_replacement_redoes_its_steps_saves_once(tmp_path):
    """Policy 'exact' under topk (a hand-over every 10 steps): group 0 SIGKILLed in step
    18; its replacement heals from the hand-over at step 10 and redoes steps 11 to 17 alone
    (0.3 s each) while group 1 waits for it at the quorum, and SIGTERM to `shoal run`
    comes then. Group 1 saves step 17, which it holds, and the replacement, which is at a
    step before it, does not save (before, it saved the step it was redoing too: two lines,
    two checkpoints)."""
    out = tmp_path / "live"
    folder = tmp_path / "ckpt"
    run = _shoal_run(out, "--replica-groups", "2", "--max-restarts", "1", steps=60,
                     job=("--compression", "topk", "--share", "1", "--kill", "0:17",
                          "--step-sleep", "0.3", "--checkpoints", f"{folder}:1000"))
    seen = ""
    try:
        while "redoes steps 11 to 17 alone" not in seen:  # (the test's timeout: a hang guard)
            line = run.stdout.readline().decode()
            assert line, seen[-4000:]
            seen += line
        time.sleep(0.3)  # in the replacement's second step of the seven
        run.send_signal(signal.SIGTERM)
        output = seen + run.communicate(timeout=TIMEOUT)[0].decode()
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert re.findall(r"preempted by SIGTERM at step (\d+): checkpoint saved", output) \
        == ["17"], output[-4000:]
    assert [p.name for p in folder.iterdir()] == ["step_000000017"]


def _torchrun_script(folder: Path, trainer_import: bool = False) -> Path:
    """A torchrun script: it sets up torch.distributed and DDP itself (``trainer_import``:
    and imports shoal.Trainer, without training through it)."""
    script = folder / "plain.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        + ("from shoal import Trainer\n" if trainer_import else "")
        + "dist.init_process_group('gloo')\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))\n"
        "model(torch.ones(2, 4)).sum().backward()\n"
        "print('world', dist.get_world_size())\n"
        "open('out.txt', 'a').write('written')\n"
        "dist.destroy_process_group()\n")
    return script


def test_a_script_without_the_trainer_is_refused_before_anything_starts(tmp_path):
    """A torchrun script under `--replica-groups 2` would be two jobs writing the same
    files (before, both trained and exit 0): refused in one line that says why and what to
    do, before any worker or lighthouse starts."""
    run = start_piped([sys.executable, "-m", "shoal", "run", "--replica-groups", "2",
                       str(_torchrun_script(tmp_path))], cwd=tmp_path)
    output = run.communicate(timeout=TIMEOUT)[0].decode()
    assert run.returncode == 2, output
    assert output.count("\n") == 1, output
    assert "does not train through shoal.Trainer" in output
    assert "run without --replica-groups, or add --independent-copies" in output
    assert not (tmp_path / "out.txt").exists()


def test_independent_copies_each_write_in_a_folder_of_their_own(tmp_path):
    """Asked for on the command line, the copies run, each in replica-group-<g>/: no two
    write the same file."""
    run = start_piped([sys.executable, "-m", "shoal", "run", "--replica-groups", "2",
                       "--independent-copies", str(_torchrun_script(tmp_path))], cwd=tmp_path)
    output = _finish(run)
    assert output.count("[group0 rank0]: world 1") == output.count(
        "[group1 rank0]: world 1") == 1, output
    assert "2 independent copies x 1 process, which never meet" in output
    assert [p.read_text() for p in sorted(tmp_path.glob("replica-group-*/out.txt"))] == \
        ["written", "written"]
    assert not (tmp_path / "out.txt").exists()


def test_a_script_that_does_not_train_through_the_trainer_is_told_its_groups_trained_apart(
        tmp_path):
    """A script that imports shoal.Trainer but sets up torch.distributed itself: each group
    is a job of its own, which never meets the other. One line says so as the script ends."""
    run = start_piped([sys.executable, "-m", "shoal", "run", "--replica-groups", "2",
                       str(_torchrun_script(tmp_path, trainer_import=True))], cwd=tmp_path)
    output = _finish(run)
    assert output.count("[group0 rank0]: world 1") == output.count(
        "[group1 rank0]: world 1") == 1, output
    assert output.count("its 2 replica groups trained apart, each a job of its own") == 1, \
        output


def test_the_groups_show_their_workers_as_torchruns_flags_say(tmp_path):
    """torchrun's flags for the elastic agent reach every replica group's launcher (before,
    they were dropped: the groups showed their lines as by default)."""
    run = start_piped([sys.executable, "-m", "shoal", "run", "--replica-groups", "2",
                       "--log-line-prefix-template", "${role_name}/${rank}> ",
                       str(_torchrun_script(tmp_path, trainer_import=True))], cwd=tmp_path)
    output = _finish(run)
    assert output.count("default/0> world 1") == 2, output
    assert "[rank0]" not in output, output


def test_a_group_that_a_signal_reaches_a_step_later_does_not_save_that_step_again(
        tmp_path, ddp_run):
    """Policy 'exact': SIGTERM reaches group 0 in step 21 and group 1 in step 22 (signals
    reach the processes of a job at slightly different times). Group 0 saves step 21 and
    stops; group 1's step 22 fails for want of it, and group 1 stops at the quorum that
    follows, holding step 21, which group 0 has saved: it does not save it again (before,
    two lines said step 21 was saved). The job then starts again from step 21 (group 0
    ended without a restart of its own) and ends bitwise equal to the run without
    failures."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--replica-groups", "2", "--max-restarts", "0",
                                job=("--kill", "0:20:SIGTERM", "--kill", "1:21:SIGTERM",
                                     "--checkpoints", f"{tmp_path / 'ckpt'}:1000")))
    assert "replica group 1: step 22 did not commit" in output, output[-4000:]
    assert re.findall(r"preempted by SIGTERM at step (\d+): checkpoint saved", output) \
        == ["21"], output[-4000:]
    assert "(step 21, epoch 0" in output, output[-4000:]  # where the restart resumed
    assert _equals_ddp(live, ddp_run())


@pytest.mark.parametrize("when", ["in the wait", "before the wait"])
def test_a_signal_to_one_process_of_a_group_at_a_quorum_stops_the_whole_group(tmp_path, when):
    """Policy 'exact', groups of 2 processes: group 1 SIGKILLed in step 7 and its replacement
    held back, so that group 0 waits for it at the quorum; SIGTERM to group 0's rank 1 alone,
    in that wait or in the failed step 7 before it (then it is raised once rank 1 has asked
    for the quorum: rank 0 waits for that request). The quorum lets rank 0 go on once the
    replacement comes, while rank 1 was stopped: both stop there and save step 6 together,
    once; group 0's agent starts it again, it resumes there and the job ends. (Before, rank
    1 stopped alone: nothing was saved, the groups waited for each other until the quorum's
    deadline, and the job started again from step 0.)"""
    out = tmp_path / "live"
    folder = tmp_path / "ckpt"
    own = ("--kill", "0:6:SIGTERM:1") if when == "before the wait" else ()
    run = _shoal_run(out, "--replica-groups", "2", "--nproc-per-node", "2",
                     "--max-restarts", "1", job=("--kill", "1:6", *own, "--late",
                                                 "--checkpoints", f"{folder}:1000"))
    try:
        deadline = time.monotonic() + TIMEOUT  # a hang guard
        while not (out / "pid.g1.a1.r1").exists():  # the replacement, held back
            assert run.poll() is None and time.monotonic() < deadline, "no replacement"
            time.sleep(0.1)
        time.sleep(1)  # group 0's step 7 fails without group 1: it waits at the quorum
        if not own:
            os.kill(int((out / "pid.g0.a0.r1").read_text()), signal.SIGTERM)
            time.sleep(1)
        (out / "go").write_text("")
        output = run.communicate(timeout=TIMEOUT)[0].decode()
    finally:
        run.kill()
    assert run.returncode == 0, output[-6000:]
    stops = re.findall(r"preempted by SIGTERM at step (\d+): checkpoint saved", output)
    assert stops == ["6"], output[-6000:]
    assert "resumed from" in output and "(step 6, epoch 0, saved by 2 processes)" in output


def test_a_group_whose_peer_stalls_as_its_own_peer_dies_is_not_stopped(tmp_path):
    """Policy 'exact', groups of 2 processes, collectives across groups given 3 s: in step 7
    group 1's rank 0 is SIGKILLed while its rank 1 stalls (8 s, in the forward pass; it
    saves on SIGTERM, so its agent waits for it), so
    that group 0's rank 0 finds its peer gone at once and is at the step's vote, while its
    rank 1 waits for its stalled peer until the collective's deadline. The vote waits for
    both: step 7 does not commit, group 0 goes on without a restart, and group 1's
    replacement heals from it. (Before, the vote had the collective's deadline too: rank 0
    gave up as rank 1 came, group 0 stopped, and the job started again from step 0.)"""
    out = tmp_path / "live"
    output = _finish(_shoal_run(out, "--replica-groups", "2", "--nproc-per-node", "2",
                                "--max-restarts", "1", "--ft-step-timeout", "3",
                                job=("--kill", "1:6", "--stall", "1:6:1:8", "--checkpoints",
                                     f"{tmp_path / 'ckpt'}:1000")))
    assert "replica group 0: step 7 did not commit" in output, output[-6000:]
    assert sorted(p.name for p in out.glob("pid.g0.*")) == ["pid.g0.a0.r0", "pid.g0.a0.r1"], \
        output[-6000:]
    assert "replica group 1: healed from a live group at step 6" in output, output[-6000:]


def _running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (a zombie has ended)."""
    left = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
    return left


def test_a_launcher_killed_leaves_no_process_of_the_job(tmp_path):
    """`shoal run` SIGKILLed mid-run (it cannot stop its children itself): the kernel sends
    each replica group's launcher a SIGTERM, which stops its workers as a preemption does
    (with a checkpoint_dir they save first), and the lighthouse stops too; so does every
    other process the launcher started. (Before, the groups went on without it, and the
    lighthouse for good.)"""
    out = tmp_path / "live"
    folder = tmp_path / "ckpt"
    run = _shoal_run(out, "--replica-groups", "2", steps=2000,
                     job=("--checkpoints", f"{folder}:1000", "--step-sleep", "0.02"))
    job: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + TIMEOUT  # a hang guard
        marker = out / "step.g0"
        while not (marker.exists() and int(marker.read_text()) >= 5):
            assert run.poll() is None and time.monotonic() < deadline, "no step 5"
            time.sleep(0.1)
        job = psutil.Process(run.pid).children(recursive=True)
        # the lighthouse, each group's launcher and its worker, and their servers
        assert len(job) >= 5, [p.cmdline()[:4] for p in job]
        run.kill()
        run.wait()
        while left := _running(job):
            assert time.monotonic() < deadline, [p.cmdline()[:4] for p in left]
            time.sleep(0.1)
    finally:
        for process in _running(job):
            process.kill()
        run.kill()
        run.stdout.close()
    assert [p.name[:5] for p in folder.iterdir()] == ["step_"]


def test_exact_with_random_augmentation_equals_the_run_without_failures(tmp_path):
    """Samples that draw random numbers as they are read (a random transform): a group
    SIGKILLed mid-step heals, and both end bitwise equal to the same run without kills."""
    calm = _shoal_run(tmp_path / "calm", "--replica-groups", "2", job=("--augment",))
    killed = _shoal_run(tmp_path / "killed", "--replica-groups", "2", "--max-restarts", "1",
                        job=("--augment", "--kill", "1:6"))
    output = _finish(killed)
    _finish(calm)
    assert "replica group 1: healed from a live group at step 6" in output
    for group in (0, 1):
        assert states_equal(final(tmp_path / "killed", group)["model"],
                            final(tmp_path / "calm", group)["model"]), group


def test_groups_of_several_processes_start_whole_under_available(tmp_path):
    """Policy 'available', 3 groups of 2 processes: the job's first step waits for every
    group, and the processes of a group decide alike whether to wait again (each alone may
    have copied another group's weights in the first quorum, or not). Before, one process
    of a group went on to its first backward while the other met the quorum again: gloo
    aborted the group ("Received data size doesn't match"), in 3 runs of 4."""
    live = tmp_path / "live"
    output = _finish(_shoal_run(live, "--nproc-per-node", "2", "--replica-groups", "3",
                                "--ft-policy", "available", steps=6))
    assert pids(live) == sorted(f"pid.g{g}.a0.r{r}" for g in range(3) for r in range(2)), \
        output[-4000:]
    finals = [final(live, group) for group in range(3)]
    assert all(f["step"] == 6 for f in finals)
    assert all(states_equal(f["model"], finals[0]["model"]) for f in finals)
