"""Frames of the worker bootstrap, hidden from the tracebacks a user reads."""

OWN_FRAMES = ("shoal/launch/worker.py", "<frozen runpy>", "/runpy.py",
              "elastic/multiprocessing/errors/__init__.py")
