"""A job's processes run as batch work (SCHED_BATCH) on Linux, every one of them: the
workers, those a restart forks, a live job's groups; ``--scheduling normal`` leaves them as
started, and a launcher started under a policy of the user's keeps it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import run_shoal

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's policies")

# (A live job's script trains through shoal.Trainer: launching one is refused otherwise.
# This one only reads its policy.)
POLICY = "import os\nfrom shoal import Trainer\n" \
         "print('scheduling-policy', os.environ.get('SHOAL_FT_GROUP', '-'), " \
         "os.environ['RANK'], os.sched_getscheduler(0))\n"


def _policies(stdout: str) -> list[tuple[str, str, int]]:
    """(group, rank, policy) of each worker that printed ``POLICY``'s line, sorted."""
    found = []
    for line in stdout.splitlines():
        _, _, text = line.partition("scheduling-policy ")
        if text:
            group, rank, policy = text.split()
            found.append((group, rank, int(policy)))
    return sorted(found)


def test_apply_scheduling_makes_this_process_batch_work_unless_told_or_set_otherwise():
    code = ("import os, sys\n"
            "from shoal.launch.scheduling import apply_scheduling\n"
            "changed = apply_scheduling(sys.argv[1])\n"
            "child = os.fork()\n"  # what a process started from here inherits
            "if child == 0:\n"
            "    os._exit(os.sched_getscheduler(0))\n"
            "print(changed, os.sched_getscheduler(0), os.waitstatus_to_exitcode("
            "os.waitpid(child, 0)[1]))\n")

    def run(scheduling: str, idle: bool = False) -> str:
        def start_idle() -> None:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

        return subprocess.run([sys.executable, "-c", code, scheduling], check=True,
                              capture_output=True, text=True, timeout=60,
                              preexec_fn=start_idle if idle else None).stdout.split()

    batch, other, idle = os.SCHED_BATCH, os.SCHED_OTHER, os.SCHED_IDLE
    assert os.sched_getscheduler(0) == other  # (this test's own process)
    assert run("batch") == ["True", str(batch), str(batch)]
    assert run("normal") == ["False", str(other), str(other)]
    assert run("batch", idle=True) == ["False", str(idle), str(idle)]


@pytest.mark.parametrize("scheduling", ["batch", "normal"])
def test_a_live_jobs_workers_run_as_asked(tmp_path, scheduling):
    pytest.importorskip("torchft")
    script = tmp_path / "job_policy.py"
    script.write_text(POLICY)
    flags = [] if scheduling == "batch" else ["--scheduling", "normal"]
    result = run_shoal("run", "--replica-groups", "2", *flags, str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    policy = os.SCHED_BATCH if scheduling == "batch" else os.SCHED_OTHER
    assert _policies(result.stdout + result.stderr) == [("0", "0", policy), ("1", "0", policy)]
