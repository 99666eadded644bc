"""`shoal.spawn`: run a function on N local processes through torch.distributed.elastic.

The processes are forked from a server process that has imported torch once (Python's
"forkserver" start method, with torch and torch._dynamo preloaded: every optimizer imports
the latter). A process then starts in a fraction of a second instead of importing torch
again (about 4 s of CPU each on a small machine). The server lives as long as the calling
process, so later calls start faster still. Where forkserver does not exist (Windows), the
processes are spawned, each importing torch.

A forked process starts with the server's environment, which is the caller's as it was when
the server started; each process is given the caller's environment as it is at the call
(with what torch.distributed.elastic sets for it on top), as a spawned one would have it.
"""

from __future__ import annotations

import multiprocessing
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
from shoal.launch.summary import classify, collect_failures, first_traceback, root_cause


class WorkerFailedError(RuntimeError):
    """A spawned worker failed; the message names the rank, the cause and its traceback."""

    def __init__(self, rank: int, cause: str, traceback: str | None):
        self.rank = rank
        self.cause = cause
        self.traceback = traceback
        detail = f"\n{traceback}" if traceback else ""
        super().__init__(f"rank {rank} failed ({cause}){detail}")


PRELOAD = ["torch", "torch._dynamo", "shoal.runtime.spawn"]
_SERVER_ENV = dict(os.environ)  # in a forkserver's children: the server's environment
_IMPORTED_BY = os.getpid()


def _start_method() -> str:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    from multiprocessing import forkserver

    # The default list (the caller's __main__) is kept; ours go first. A server that is
    # already running keeps what it has preloaded.
    preload = getattr(forkserver._forkserver, "_preload_modules", ["__main__"])
    multiprocessing.set_forkserver_preload([*PRELOAD, *(m for m in preload
                                                        if m not in PRELOAD)])
    return "forkserver"


def _in_callers_environment(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in the environment ``env`` of the caller of spawn, plus what
    torch.distributed.elastic set for this process (RANK, MASTER_ADDR, ...)."""
    if _IMPORTED_BY != os.getpid():
        # Forked from a server that preloaded this module: what differs from the server's
        # environment was set by elastic.
        elastic = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(elastic)
    else:
        # A fresh interpreter (spawned, or a server that did not preload us): it already
        # has the caller's environment, unless the server was older than the call.
        for key, value in env.items():
            os.environ.setdefault(key, value)
    return fn(*args)


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple = (), *,
          max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` processes; return each rank's result, by rank.

    Each process gets the launcher environment, so ``shoal.init()`` inside ``fn`` joins the
    group. ``fn`` must be importable by name (defined at module top level).
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
        start_method=_start_method(),
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        local_addr="127.0.0.1",
    )
    from shoal.launch.launcher import fresh_store_per_attempt, quiet_torch_logs

    quiet_torch_logs()
    fresh_store_per_attempt(max_restarts > 0)
    try:
        results = elastic_launch(config, _in_callers_environment)(dict(os.environ), fn, *args)
    except ChildFailedError as failed:
        rank, failure = root_cause(collect_failures(failed, log_dir))
        raise WorkerFailedError(rank, classify(failure).text,
                                first_traceback(failure, log_dir)) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)  # the error, if any, is in the exception
    return [results[r] for r in range(nprocs)]
