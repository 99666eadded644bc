"""Imported once, by the forkserver itself when it starts (the first name of ``PRELOAD`` in
shoal.launch.forkserver), and by nothing else.

A scheduler signals every process of a job step: SLURM's ``scancel --signal=USR1`` and the
SIGTERM before a kill reach the server too. The server must not die of them: its children
get PDEATHSIG when it ends, so a worker would be killed in the middle of the checkpoint the
signal asked for. The server ignores them, and ends when its starter does (its pipe closes);
``in_callers_environment`` gives every forked process the default handlers back.


When its starter ends, the server ends at once, without tearing down the torch it imported
(about 1 s of CPU, while it holds its starter's stdout and stderr: `shoal run ... | cat`
would end that much later than the launcher).

Its command line says what it is (``ps``, ``pkill -f``): ``shoal forkserver``, with the pid of
the launcher (or the process of ``shoal.spawn``) it serves, not the worker module it
preloads; a worker forked from it names itself anew (shoal.launch.worker).
"""

import atexit
import os
import sys

from shoal.launch.forkserver import become_server_process

_SERVER = os.getpid()


def _end_at_once() -> None:
    # Registered before torch is imported, so run after torch's own exit functions; skipped
    # where the server ends by an error (its status stays 1) and in forked processes.
    if os.getpid() != _SERVER or hasattr(sys, "last_value"):
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


atexit.register(_end_at_once)
become_server_process()
