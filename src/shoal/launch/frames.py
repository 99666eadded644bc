"""What the worker bootstrap and the launcher's failure summary both know: the bootstrap's
frames, hidden from the tracebacks a user reads, the file where a worker leaves its pid, and
the errors of a rank that lost a peer. (No torch here: a worker reads it as it fails.)"""

import re

OWN_FRAMES = ("shoal/launch/worker.py", "<frozen runpy>", "/runpy.py",
              "elastic/multiprocessing/errors/__init__.py")

# Written by each worker beside its error file, "PID RANK": torch names only the failures it
# saw itself, with their pids; the summary reads the others' from there, and the output
# relay each rank's global rank.
PID_FILE = "pid"

# Errors a rank raises because another rank died: never the root cause while a rank with an
# error of its own exists.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "remote worker",
             "Broken pipe", "NCCL communicator was aborted")

_SOURCE_PATH = re.compile(r"\[/[^\]]*\] ")


def peer_lost(message: str) -> str | None:
    """The first line of an error that says a peer is gone, without gloo's source path and
    advice; None for any other error."""
    if not any(marker in message for marker in _PEER_LOST):
        return None
    first = _SOURCE_PATH.sub("", message.splitlines()[0])
    return first.split(". This is typically caused by", 1)[0]
