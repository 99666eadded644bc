"""Faults at random moments, as a test: a seeded schedule (``Schedule.draw``) of SIGKILLs,
SIGSTOPs, a lighthouse or a group's launcher killed, and a kill after the last step, put on
a running `shoal run` job (``Chaos``, which finds the job's processes from its launcher's
pid and its ``--log-dir``). The seed is printed with the schedule, so a failing one replays
exactly.

    schedule = Schedule.draw(seed, groups=3, ranks=2, kills=6, stops=1)
    print(schedule)
    with Chaos(schedule, JobProcesses(launcher.pid, log_dir), last_step=900) as chaos:
        launcher.wait()
    print("\\n".join(chaos.log))
"""

from shoal.chaos.inject import Chaos, ChaosRun, JobProcesses, run_under
from shoal.chaos.schedule import KINDS, Fault, Schedule

__all__ = ["KINDS", "Chaos", "ChaosRun", "Fault", "JobProcesses", "Schedule", "run_under"]
