"""`shoal.spawn`: run a function on N local processes through torch.distributed.elastic.

On Linux the processes are forked from a server process that has imported torch once
(Python's "forkserver" start method, with torch and torch._dynamo preloaded: every optimizer
imports the latter). A process then starts in a fraction of a second instead of importing
torch again (about 4 s of CPU each on a small machine). The server lives as long as the
calling process, so later calls start faster still. Elsewhere the processes are spawned,
each importing torch.

A forked process starts with the server's environment, which is the caller's as it was when
the server started; each process is given the caller's environment as it is at the call,
with what torch.distributed.elastic sets for it on top. Settings that torch reads once when
it is imported (e.g. TORCH_COMPILE_DISABLE) stay as they were when the server started.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shoal.errors import UsageError
from shoal.launch.forkserver import in_callers_environment, start_method
from shoal.launch.summary import classify, collect_failures, first_traceback, root_cause


class WorkerFailedError(RuntimeError):
    """A spawned worker failed; the message names the rank, the cause and its traceback.

    Raised by ``shoal.spawn`` when a worker raises, exits with a non-zero code or is killed,
    and no restart is left (``max_restarts``).
    """

    def __init__(self, rank: int, cause: str, traceback: str | None):
        self.rank = rank
        self.cause = cause
        self.traceback = traceback
        detail = f"\n{traceback}" if traceback else ""
        super().__init__(f"rank {rank} failed ({cause}){detail}")


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple = (), *,
          max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` processes; return each rank's result, by rank.

    Each process gets the launcher environment, so ``shoal.init()`` inside ``fn`` joins the
    group. ``fn`` must be importable by name (defined at module top level).

    Raises:
        UsageError: If ``nprocs`` is below 1.
        WorkerFailedError: If a worker raises, exits with a non-zero code or is killed, and
            no restart is left; the message names its rank, the cause and the traceback.
        pickle.PicklingError: If ``fn`` or ``args`` cannot be pickled, e.g. a lambda (some
            objects raise TypeError or AttributeError instead).
    """
    if nprocs < 1:
        raise UsageError(f"nprocs must be at least 1, got {nprocs}")
    log_dir = tempfile.mkdtemp(prefix="shoal-spawn-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"shoal-spawn-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={},
        max_restarts=max_restarts,
        monitor_interval=0.05,
        start_method=start_method(),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        local_addr="127.0.0.1",
    )
    from shoal.launch.launcher import fresh_store_per_attempt, quiet_torch_logs

    quiet_torch_logs()
    fresh_store_per_attempt(max_restarts > 0)
    try:
        results = elastic_launch(config, in_callers_environment)(dict(os.environ), fn, *args)
    except ChildFailedError as failed:
        rank, failure = root_cause(collect_failures(failed, log_dir))
        raise WorkerFailedError(rank, classify(failure).text,
                                first_traceback(failure, log_dir)) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)  # the error, if any, is in the exception
    return [results[r] for r in range(nprocs)]
