"""What torch's elastic agent is taught about the workers it forks from shoal's preloaded
server (shoal.launch.worker_start), so that they end as workers started as commands do.

Two changes to ``MultiprocessContext``, the part of elastic that runs workers as functions,
each made only where the torch in use has what it reads (else left as it is):

- a worker that ends with status 0 (``os._exit(0)``) has finished, as a command has;
- a server that has ended (SIGKILLed, the OOM killer, ``pkill``) is replaced when the next
  attempt's workers start, and the launcher says so in one line.
"""

from __future__ import annotations

import sys
import time

from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from shoal.launch.forkserver import forget_ended_server

_SERVER_EXIT_WAIT_S = 5.0  # a server that broke off a start is dying: it ends within this


def teach_elastic_forked_workers() -> None:
    """Make both changes (once per process)."""
    _count_a_clean_exit_as_finished()
    _replace_an_ended_server()


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
    MultiprocessContext._poll = _poll
    return True


def _say_replaced(ended: tuple[int, str] | None) -> None:
    if ended is not None:
        pid, how = ended
        sys.stderr.write(f"shoal: the workers' server (shoal forkserver, pid {pid}) {how}: "
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
    MultiprocessContext._start = _start
    return True
