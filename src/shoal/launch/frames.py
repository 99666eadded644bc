"""What the worker bootstrap and the launcher's failure summary both know: the bootstrap's
frames, hidden from the tracebacks a user reads, and the file where a worker leaves its pid."""

OWN_FRAMES = ("shoal/launch/worker.py", "<frozen runpy>", "/runpy.py",
              "elastic/multiprocessing/errors/__init__.py")

# Written by each worker beside its error file, "PID RANK": torch names only the failures it
# saw itself, with their pids; the summary reads the others' from there, and the output
# relay each rank's global rank.
PID_FILE = "pid"
