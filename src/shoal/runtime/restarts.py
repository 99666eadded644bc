"""The failures a job under `shoal run` was restarted after, as a restarted worker reads
them: shoal.launch.restarts writes one JSON line per failure, before the workers of the
next attempt start, to the file named by ``SHOAL_RESTARTS_FILE``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

RESTARTS_FILE_ENV = "SHOAL_RESTARTS_FILE"


@dataclass(frozen=True)
class AttemptFailure:
    """The first failure of one attempt (1 is the first start)."""

    attempt: int
    rank: int
    pid: int
    cause: str
    exit_code: int
    time: float

    def describe(self) -> str:
        pid = f" (pid {self.pid})" if self.pid else ""
        return f"rank {self.rank} {self.cause}{pid}"


def restart_cause(restart: int) -> AttemptFailure | None:
    """In a worker: the failure that its attempt (``TORCHELASTIC_RESTART_COUNT``) was
    restarted after, or None (a first start, or not under `shoal run`)."""
    path = os.environ.get(RESTARTS_FILE_ENV)
    if restart < 1 or not path:
        return None
    try:
        with open(path) as f:
            lines = f.read().splitlines()
        return AttemptFailure(**json.loads(lines[restart - 1]))
    except (OSError, IndexError, ValueError, TypeError):
        return None
