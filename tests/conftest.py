"""Test settings shared by every test: one thread per process, clean distributed state."""

import os

import pytest

# Set before any test starts processes: children inherit one compute thread each.
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto`` (set in pyproject.toml): one more than the CPUs this process may
    use, because most tests spend part of their time waiting on the processes they start
    (rendezvous, injected hangs, restarts); at most 8, so that the jobs they start do not
    crowd a large machine's network ports and memory."""
    return min(len(os.sched_getaffinity(0)) + 1, 8)


@pytest.fixture
def single_process():
    """A world-size-1 process group in the test process, destroyed afterwards."""
    import shoal

    shoal.init("gloo")
    yield
    shoal.cleanup()
