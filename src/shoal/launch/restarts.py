"""What a restart says: a line for each failure the workers are restarted after, and the
list of every attempt's first failure when the restarts run out.

torch's elastic agent restarts the worker group by itself, and tells of it only in its own
log records (which shoal keeps quiet). ``RestartLog`` sees what the agent sees: each check
of the workers (``LocalElasticAgent._monitor_workers``) that finds them failed while
restarts are left is followed by a restart. It names the rank that failed first (as the
failure summary does: its own error before a lost peer's) and prints one line:

    shoal: attempt 1 of 3 failed: rank 1 killed by SIGKILL (pid 4242); restarting all
    workers (2 restarts left)

Each such failure is also kept, a JSON line each, in the file named by
``SHOAL_RESTARTS_FILE``, where a restarted Trainer finds the failure it restarts after
and writes it to the run's metrics events (shoal.metrics.recorder).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from shoal.launch.output import shoal_says
from shoal.launch.summary import classify, collect_failures, root_cause
from shoal.runtime.restarts import RESTARTS_FILE_ENV, AttemptFailure

_active: RestartLog | None = None  # the job's, while it runs


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class RestartLog:
    """Tells of each restart of the job it is installed for; ``attempts`` holds every
    first failure so far."""

    def __init__(self, log_dir: str, max_restarts: int, first_rank: int = 0):
        self.log_dir = log_dir
        self.max_restarts = max_restarts
        self.first_rank = first_rank
        self.attempts: list[AttemptFailure] = []
        self.path = os.path.join(log_dir, "restarts.jsonl")

    def install(self) -> RestartLog:
        """Watch the agent's checks, and name the events file for the workers."""
        global _active
        _watch_the_agent()
        os.environ[RESTARTS_FILE_ENV] = self.path
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        _active = None
        if os.environ.get(RESTARTS_FILE_ENV) == self.path:
            del os.environ[RESTARTS_FILE_ENV]  # a later job in this process has its own

    def restarting(self, failures: dict, left: int) -> None:
        """The workers failed with ``failures`` (by global rank) and are restarted, with
        ``left`` restarts left before this one."""
        failures = collect_failures(ChildFailedError("worker", dict(failures)), self.log_dir,
                                    self.first_rank)
        rank, failure = root_cause(failures)
        cause = classify(failure)
        told = AttemptFailure(attempt=len(self.attempts) + 1, rank=rank, pid=failure.pid,
                              cause=cause.text, exit_code=cause.exit_code, time=time.time())
        self.attempts.append(told)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(told)) + "\n")
        sys.stderr.write(f"{shoal_says()}attempt {told.attempt} of {self.max_restarts + 1} failed: "
                         f"{told.describe()}; restarting all workers "
                         f"({_plural(left - 1, 'restart')} left)\n")
        sys.stderr.flush()


def _watch_the_agent() -> bool:
    """Wrap the agent's check of its workers (once per process); a torch without it, or
    without its count of restarts left, is left as it is (no restart lines then)."""
    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None or getattr(original, "_shoal", False):
        return original is not None

    def _monitor_workers(self, worker_group):
        result = original(self, worker_group)
        left = getattr(self, "_remaining_restarts", 0)
        if _active is not None and result.is_failed() and left > 0:
            try:
                _active.restarting(result.failures, left)
            except Exception as exc:  # noqa: BLE001 - a report must never stop the job
                sys.stderr.write(f"shoal: could not tell of a restart: {exc}\n")
        return result

    _monitor_workers._shoal = True  # type: ignore[attr-defined]
    # (mypy refuses any assignment to a method: this one patches torch's class)
    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]
    return True
