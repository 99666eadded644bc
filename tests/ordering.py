"""The order the suite runs in, and its quick tier, from the tests' recorded durations.

``tests/durations.json`` holds each test's measured time (setup + call + teardown, seconds),
written by ``pytest --store-durations`` (a full run; a partial run updates only its tests).
From it:

- the longest tests start first. pytest-xdist hands tests out in collection order, so the
  last test to start is a short one, not a minute-long one that ends the run alone on one
  worker while the others idle (longest processing time first).
- ``pytest -m quick`` runs the tests recorded under ``QUICK_SECONDS``.

A test missing from the file (a new one) counts as ``UNKNOWN_SECONDS`` and is not quick
until the file is written again. A stale file costs only order, never a result.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

FILE = Path(__file__).with_name("durations.json")
QUICK_SECONDS = 1.0
UNKNOWN_SECONDS = 5.0


@functools.cache
def _shares_a_job(path: Path) -> bool:
    return path.is_file() and 'scope="module"' in path.read_text()


def unit(rootpath: Path, nodeid: str) -> str:
    """What one worker runs in one piece: a module that defines a module-scoped fixture (one
    job whose results its tests check) as a whole, any other test alone."""
    path = nodeid.split("::", 1)[0]
    return path if _shares_a_job(rootpath / path) else nodeid


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test's time to {FILE.name} (orders the suite and "
                          "picks the quick tier)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"quick: recorded under {QUICK_SECONDS:g} s in tests/durations.json "
                   "(`pytest -m quick`, the development tier)")
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Store())


def order(nodeids: list[str], recorded: dict[str, float],
          unit_of: Callable[[str], str]) -> list[str]:
    """``nodeids`` by unit (``unit_of``), the units by their recorded seconds, longest first;
    the tests of a unit, and units of equal cost, keep their order (sorted is stable)."""
    units: dict[str, list[str]] = {}
    for nodeid in nodeids:
        units.setdefault(unit_of(nodeid), []).append(nodeid)

    def cost(tests: list[str]) -> float:
        return sum(recorded.get(nodeid, UNKNOWN_SECONDS) for nodeid in tests)

    return [nodeid for tests in sorted(units.values(), key=cost, reverse=True)
            for nodeid in tests]


def recorded() -> dict[str, float]:
    return json.loads(FILE.read_text()) if FILE.is_file() else {}


@pytest.hookimpl(tryfirst=True)  # before `-m quick` selects by the mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = recorded()
    for item in items:
        if seconds.get(item.nodeid, UNKNOWN_SECONDS) < QUICK_SECONDS:
            item.add_marker(pytest.mark.quick)
    by_id = {item.nodeid: item for item in items}
    items[:] = [by_id[nodeid] for nodeid in order(
        list(by_id), seconds, functools.partial(unit, config.rootpath))]


class _Store:
    """With ``--store-durations``, on the process that sees every report (xdist's controller,
    or the only one): add up each test's phases and write them at the end."""

    def __init__(self) -> None:
        self.measured: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        seconds = recorded()
        seconds.update({nodeid: round(took, 2) for nodeid, took in self.measured.items()})
        FILE.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
