"""Imported once, by the forkserver itself when it starts (the first name of ``PRELOAD`` in
shoal.launch.forkserver), and by nothing else.

A scheduler signals every process of a job step: SLURM's ``scancel --signal=USR1`` and the
SIGTERM before a kill reach the server too. The server must not die of them: its children
get PDEATHSIG when it ends, so a worker would be killed in the middle of the checkpoint the
signal asked for. The server ignores them, and ends when its starter does (its pipe closes);
``in_callers_environment`` gives every forked process the default handlers back.


Its command line says what it is (``ps``, ``pkill -f``): ``shoal forkserver``, with the pid of
the launcher (or the process of ``shoal.spawn``) it serves, not the worker module it
preloads; a worker forked from it names itself anew (shoal.launch.worker).
"""

import os
import signal

import setproctitle

from shoal.launch.forkserver import STEP_SIGNALS

for _signum in STEP_SIGNALS:
    signal.signal(_signum, signal.SIG_IGN)
setproctitle.setproctitle(f"shoal forkserver (serves pid {os.getppid()})")
