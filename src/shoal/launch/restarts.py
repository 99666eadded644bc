"""What a restart says: a line for each failure the workers are restarted after, and the
list of every attempt's first failure when the restarts run out.

torch's elastic agent restarts the worker group by itself and tells of it only in its own
log records (which shoal keeps quiet): which worker process it saw fail, with its exit code
and pid, then how many restarts are left. ``RestartLog`` reads those two records, names
the rank that failed first (as the failure summary does: its own error before a lost
peer's), and prints one line:

    shoal: attempt 1 of 3 failed: rank 1 killed by SIGKILL (pid 4242); restarting all
    workers (2 restarts left)

Each such failure is also kept, a JSON line each, in the file named by
``SHOAL_RESTARTS_FILE``, where a restarted Trainer finds the failure it restarts after
and writes it to the run's metrics events (shoal.metrics.recorder).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shoal.launch.summary import classify, collect_failures, latest_attempt_dir, root_cause
from shoal.runtime.restarts import RESTARTS_FILE_ENV, AttemptFailure

# The records of torch's agent that this reads (every torch release shoal supports).
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.api")
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\)\s+local_rank: (\d+) \(pid: (\d+)\)")
_RESTARTING = re.compile(r"(\d+)/(\d+) attempts left;\s*will restart worker group")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class RestartLog(logging.Filter):
    """Reads the agent's records (a filter on its loggers, so that it sees them whatever
    is printed) and tells of each restart; ``attempts`` holds every first failure so far."""

    def __init__(self, log_dir: str, max_restarts: int, first_rank: int = 0,
                 shown_level: int = logging.CRITICAL):
        super().__init__()
        self.log_dir = log_dir
        self.max_restarts = max_restarts
        self.first_rank = first_rank
        self.shown_level = shown_level
        self.attempts: list[AttemptFailure] = []
        self._seen: ProcessFailure | None = None
        self.path = os.path.join(log_dir, "restarts.jsonl")

    def install(self) -> RestartLog:
        """Attach to the agent's loggers and name the events file for the workers."""
        os.environ[RESTARTS_FILE_ENV] = self.path
        for name in AGENT_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(min(self.shown_level, logging.INFO))
            logger.addFilter(self)
        return self

    def uninstall(self) -> None:
        for name in AGENT_LOGGERS:
            logging.getLogger(name).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            self._read(record.getMessage())
        except Exception as exc:  # noqa: BLE001 - a report must never stop the job
            sys.stderr.write(f"shoal: could not tell of a restart: {exc}\n")
        return record.levelno >= self.shown_level

    def _read(self, message: str) -> None:
        failed = _FAILED.search(message)
        if failed:
            exit_code, local_rank, pid = map(int, failed.groups())
            self._seen = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exit_code,
                                        error_file=self._error_file(local_rank))
            return
        restarting = _RESTARTING.search(message)
        if restarting and self._seen is not None:
            self._restarting(int(restarting.group(1)))

    def _error_file(self, local_rank: int) -> str:
        attempt = latest_attempt_dir(self.log_dir)
        return os.path.join(attempt or self.log_dir, str(local_rank), "error.json")

    def _restarting(self, left: int) -> None:
        seen, self._seen = self._seen, None
        failures = collect_failures(
            ChildFailedError("worker", {self.first_rank + seen.local_rank: seen}),
            self.log_dir, self.first_rank)
        rank, failure = root_cause(failures)
        cause = classify(failure)
        failure_ = AttemptFailure(attempt=len(self.attempts) + 1, rank=rank, pid=failure.pid,
                                  cause=cause.text, exit_code=cause.exit_code,
                                  time=time.time())
        self.attempts.append(failure_)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(failure_)) + "\n")
        sys.stderr.write(f"shoal: attempt {failure_.attempt} of {self.max_restarts + 1} "
                         f"failed: {failure_.describe()}; restarting all workers "
                         f"({_plural(left - 1, 'restart')} left)\n")
        sys.stderr.flush()
