"""How the elastic agent starts a worker of `shoal run`: forked, or as a new command.

The first attempt's workers of `shoal run` start as new processes, as torchrun starts
them: a script's first line runs as soon as under torchrun. Those of `shoal train` and
`shoal rl` (shoal's own entry, which imports torch first anyway) are forked from the start,
from a server started at once: a node of N workers imports torch once, not N times
(measured: 4 digits workers, 13.6 s of CPU to start and train 5 steps as commands, 5.7 s
forked). On Linux, every later attempt's workers are
forked from a server process that has imported torch and torch._dynamo (every optimizer
imports it) once (shoal.launch.forkserver), which is started a few seconds into the job (or
at the first restart) and lives as long as the launcher: a worker restarted after a failure
(``--max-restarts``) starts in a fraction of a second instead of importing torch again.
It gets the launcher's environment as it was when the job started, with what
torch.distributed.elastic sets for it on top, and the launcher's working directory, as a
worker started as a command does. Settings that torch reads once when it is imported stay
as they were when the server started.

Elsewhere, or with ``--no-preload``, each worker is a new process,
``python -m shoal.launch.worker [-m] ENTRY ARGS...``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass

from shoal.launch.config import LaunchSpec
from shoal.launch.forked import teach_elastic_forked_workers
from shoal.launch.forkserver import in_callers_environment, start_method

# Set for the launcher of a live mode's replica group (shoal.launch.groups): its first workers
# are forked too, from a server started at once, since a group that fails early must be
# replaced in a fraction of a second like any other.
FORK_FIRST_ENV = "SHOAL_FORK_FIRST"


@dataclass(frozen=True)
class WorkerStart:
    """What elastic_launch is given to start each worker."""

    entrypoint: str | Callable
    """A command (the Python interpreter) or a function run in a forked process."""
    args: tuple
    """The command's arguments, or the function's."""
    start_method: str
    """How a function's process is started ("forkserver" or "spawn"); unused for a command."""
    first: WorkerStart | None = None
    """How the first attempt's workers start, where it differs (commands, before any
    server has imported torch); None: as every other attempt's."""


def worker_argv(spec: LaunchSpec) -> list[str]:
    """``-m shoal.launch.worker [-m] ENTRY ARGS...``: the worker as a Python command."""
    argv = ["-m", "shoal.launch.worker"]
    if spec.module:
        argv.append("-m")
    return [*argv, spec.entry, *spec.args]


def forks_workers(spec: LaunchSpec) -> bool:
    """Whether any worker of ``spec`` is forked from the preloaded server."""
    return not spec.no_python and spec.preload and start_method() == "forkserver"


def worker_start(spec: LaunchSpec) -> WorkerStart:
    """Forked from the preloaded server where there is one and ``spec.preload``, else a
    command."""
    if spec.no_python:  # torchrun's --no-python: the program itself, without a bootstrap
        return WorkerStart(shutil.which(spec.entry) or os.path.abspath(spec.entry),
                           tuple(spec.args), "spawn")
    argv = worker_argv(spec)[2:]  # what shoal.launch.worker itself is given
    if forks_workers(spec):
        # Not at the top: `python -m shoal.launch.worker` imports this package first, and
        # runpy warns of a module found imported before it runs.
        from shoal.launch.worker import run_forked

        teach_elastic_forked_workers()
        # The arguments one by one, so that elastic substitutes ${local_rank} in them as it
        # does in a command's.
        forked_first = spec.ours or os.environ.get(FORK_FIRST_ENV) == "1"
        return WorkerStart(in_callers_environment,
                           (dict(os.environ), run_forked, os.getcwd(), *argv), "forkserver",
                           first=None if forked_first else
                           WorkerStart(sys.executable, tuple(worker_argv(spec)), "spawn"))
    return WorkerStart(sys.executable, tuple(worker_argv(spec)), "spawn")
