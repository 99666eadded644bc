"""The suite's order and its quick tier (tests/ordering.py)."""

from __future__ import annotations

from pathlib import Path

from tests import ordering

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"


def test_longest_units_first_and_a_units_tests_together_in_their_order():
    recorded = {"a.py::x": 1.0, "b.py::y": 9.0, "c.py::z1": 3.0, "c.py::z2": 4.0}
    nodeids = ["a.py::x", "c.py::z1", "new.py::n", "b.py::y", "c.py::z2"]

    def unit_of(nodeid: str) -> str:
        return "c.py" if nodeid.startswith("c.py") else nodeid

    # An unrecorded test counts UNKNOWN_SECONDS (5): between c.py (7 s) and a.py.
    assert ordering.order(nodeids, recorded, unit_of) == [
        "b.py::y", "c.py::z1", "c.py::z2", "new.py::n", "a.py::x"]


def test_the_quick_tier_has_tests_of_every_source_folder():
    quick = {nodeid.split("/")[1] for nodeid, seconds in ordering.recorded().items()
             if seconds < ordering.QUICK_SECONDS}
    folders = {path.name for path in SRC.iterdir()
               if path.is_dir() and (path / "__init__.py").is_file()}
    assert folders - quick == set()
