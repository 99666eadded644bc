"""How Linux schedules a job's processes: as batch work (``SCHED_BATCH``) unless told not to.

A training job's processes are throughput work. Under Linux's normal policy a thread that
wakes (gloo's threads as a collective completes, torchft's manager threads, the agents'
monitor loops, the lighthouse) takes the core from a worker in the middle of its step
wherever the job's processes outnumber the cores; under ``SCHED_BATCH`` a waking thread
waits for the running one's time slice to end or for it to block, and every process keeps
its share of the CPU (nice values as they were). `shoal run`, `shoal train` and `shoal rl`
set it on themselves before they start anything, so that the lighthouse, the agents, the
preloaded server and every worker (and their threads and data loaders) inherit it.
``--scheduling normal`` leaves every process as it was started; a launcher that was
started under another policy than the normal one (``chrt``, ``schedtool``) keeps it.
Measured in docs/launcher.md ("Scheduling").
"""

from __future__ import annotations

import os
from typing import Literal, get_args

Scheduling = Literal["batch", "normal"]
SCHEDULINGS: tuple[Scheduling, ...] = get_args(Scheduling)


def apply_scheduling(scheduling: Scheduling) -> bool:
    """Make this thread, and every process and thread it starts from now on, batch work
    where asked and where the policy is the normal one (Linux); whether it changed."""
    if scheduling != "batch" or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:  # the user's choice, kept
            return False
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a sandbox that forbids it: the job runs as it would have
        return False
    return True
