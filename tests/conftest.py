"""Test settings shared by every test: one thread per process, clean distributed state."""

import os

import pytest

# Set before any test starts processes: children inherit one compute thread each.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture
def single_process():
    """A world-size-1 process group in the test process, destroyed afterwards."""
    import shoal

    shoal.init("gloo")
    yield
    shoal.cleanup()
