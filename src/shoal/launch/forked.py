"""What torch's elastic agent is taught about the workers it forks from shoal's preloaded
server (shoal.launch.worker_start), so that they end as workers started as commands do, and
start no later than torchrun's.

Each change is made only where the torch in use has what it reads (else it is left as it
is):

- the first attempt's workers start as commands (``first_attempt_as``), as torchrun starts
  them, so that nothing waits for a server to import torch; the server is started a few
  seconds later, in the background, for the restarts;
- a forked worker that ends with status 0 (``os._exit(0)``) has finished, as a command has;
- a server that has ended (SIGKILLed, the OOM killer, ``pkill``) is replaced when the next
  attempt's workers start, and the launcher says so in one line.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from shoal.launch.forkserver import forget_ended_server, start_server
from shoal.launch.output import shoal_says

_SERVER_EXIT_WAIT_S = 5.0  # a server that broke off a start is dying: it ends within this
# The server is started this long after the first workers, so that its imports do not slow
# theirs; a restart before then starts it at once.
SERVER_DELAY_S = 5.0
_first: Any = None  # shoal.launch.worker_start.WorkerStart of the next job's first attempt
_prewarm = True  # whether the next job may start its workers again (restarts, nodes joining)
_timers: list[threading.Timer] = []


def teach_elastic_forked_workers() -> None:
    """Make the changes (once per process)."""
    _count_a_clean_exit_as_finished()
    _replace_an_ended_server()
    _start_the_first_attempt_apart()


def first_attempt_as(start: Any, again: bool = True) -> None:
    """The next job's first attempt starts its workers as ``start`` says (a WorkerStart
    of commands); every later attempt forks them. ``again``: whether the job may start its
    workers again at all; if not, no server is started for it."""
    global _first, _prewarm
    _first, _prewarm = start, again


def cancel_server_start() -> None:
    """The job has ended: a server not started yet is not needed."""
    while _timers:
        _timers.pop().cancel()


def _start_the_first_attempt_apart() -> bool:
    original = LocalElasticAgent._start_workers
    if getattr(original, "_shoal", False):
        return True

    def _start_workers(self, worker_group):
        global _first
        first, spec = _first, worker_group.spec
        if first is None or getattr(self, "_shoal_started", False) or \
                not hasattr(spec, "entrypoint") or not callable(spec.entrypoint):
            return original(self, worker_group)
        self._shoal_started, _first = True, None
        forked = spec.entrypoint, spec.args
        spec.entrypoint, spec.args = first.entrypoint, first.args
        try:
            started = original(self, worker_group)
        finally:
            spec.entrypoint, spec.args = forked
        if _prewarm:  # the server for the restarts, once these workers are under way
            timer = threading.Timer(SERVER_DELAY_S, start_server)
            timer.daemon = True
            timer.start()
            _timers.append(timer)
        return started

    _start_workers._shoal = True  # type: ignore[attr-defined]
    # (mypy refuses any assignment to a method: this one patches torch's class)
    LocalElasticAgent._start_workers = _start_workers  # type: ignore[method-assign]
    return True


def _count_a_clean_exit_as_finished() -> bool:
    """A forked worker that ended with status 0 has finished.

    elastic learns that a worker run as a function finished from the value it hands back,
    and waits for that value: a script ending in ``os._exit(0)`` hands back none, and the
    job would wait forever (a worker run as a command is judged by its status alone, as
    torchrun judges it). A forked worker that ended with 0 is given the empty value it
    would have returned. A torch whose ``MultiprocessContext`` lacks what this reads is
    left as it is; returns whether it was changed.
    """
    original = MultiprocessContext._poll
    if getattr(original, "_shoal", False):
        return True
    probe = MultiprocessContext.__init__.__code__.co_names
    if not {"_ret_vals", "_return_values", "_pc"} <= set(probe):
        return False

    def _poll(self):
        if self._pc is not None:
            for local_rank, process in enumerate(self._pc.processes):
                # A worker that handed back its value waits until elastic has read them
                # all, so one that has ended with 0 before that never handed one back.
                if (local_rank not in self._return_values and process.exitcode == 0
                        and self._ret_vals[local_rank].empty()):
                    self._return_values[local_rank] = None
        return original(self)

    _poll._shoal = True  # type: ignore[attr-defined]
    # (mypy refuses any assignment to a method: this one patches torch's class)
    MultiprocessContext._poll = _poll  # type: ignore[method-assign]
    return True


def _say_replaced(ended: tuple[int, str] | None) -> None:
    if ended is not None:
        pid, how = ended
        sys.stderr.write(f"{shoal_says()}the workers' server (shoal forkserver, pid {pid}) {how}: "
                         "a new one starts this attempt's workers\n")
        sys.stderr.flush()


def _replace_an_ended_server() -> bool:
    """Before each attempt's workers start, a server found ended is forgotten (the start
    then makes a new one). A server that ends while it starts them breaks the start off
    (EOFError, a reset connection): it is waited for, forgotten, and the start is made
    again once, with a new server."""
    original = MultiprocessContext._start
    if getattr(original, "_shoal", False):
        return True
    if "_pc" not in MultiprocessContext.__init__.__code__.co_names:
        return False

    def _start(self):
        _say_replaced(forget_ended_server())
        try:
            return original(self)
        except (EOFError, ConnectionError) as exc:
            deadline = time.monotonic() + _SERVER_EXIT_WAIT_S
            ended = forget_ended_server()
            while ended is None and time.monotonic() < deadline:
                time.sleep(0.05)
                ended = forget_ended_server()
            if ended is None:
                raise
            # Whatever this start forked is gone with the server (PDEATHSIG).
            self._pc = None
            _say_replaced((ended[0], f"{ended[1]} while it started workers ({exc!r})"))
            return original(self)

    _start._shoal = True  # type: ignore[attr-defined]
    # (mypy refuses any assignment to a method: this one patches torch's class)
    MultiprocessContext._start = _start  # type: ignore[method-assign]
    return True
