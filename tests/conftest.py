"""Test settings shared by every test: one thread per process, clean distributed state."""

import compileall
import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.ordering"]

# Set before any test starts processes: children inherit one compute thread each.
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile shoal's and the tests' modules to bytecode once, before any test starts: the
    suite starts about a thousand interpreters, and where PYTHONDONTWRITEBYTECODE is set
    (CI images often set it) each would compile them again (about 0.15 s of CPU each).
    Python still reads bytecode that is there; up-to-date files are skipped."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller did it
        return
    root = Path(__file__).parent.parent
    for folder in (root / "src" / "shoal", root / "tests"):
        compileall.compile_dir(folder, quiet=2)


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto`` (set in pyproject.toml): one more than the CPUs this process may
    use, because most tests spend part of their time waiting on the processes they start
    (rendezvous, injected hangs, restarts); at most 8, so that the jobs they start do not
    crowd a large machine's network ports and memory."""
    return min(len(os.sched_getaffinity(0)) + 1, 8)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load scheduling in the collection's order (longest first:
    tests/ordering.py), except that the tests of a module that defines a module-scoped fixture
    (one job whose results its tests check) go to one worker, so the job runs once, not once
    per worker. (pytest-xdist's own ``xdist_group`` marks are lost on pytest 9's node ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    from tests import ordering  # here, not at the top: pytest_plugins imports it first

    config.option.loadscopereorder = False  # keep the order tests/ordering.py made

    class SharedJobScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ordering.unit(config.rootpath, nodeid)

    return SharedJobScheduling(config, log)


@pytest.fixture
def single_process():
    """A world-size-1 process group in the test process, destroyed afterwards."""
    import shoal

    shoal.init("gloo")
    yield
    shoal.cleanup()


@pytest.fixture(autouse=True)
def _environment_kept():
    """What a test sets in this process's environment (a launcher called in-process sets
    its workers' interface and rendezvous variables) does not reach the processes that
    later tests start."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
