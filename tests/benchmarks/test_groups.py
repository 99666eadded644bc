"""benchmarks/groups.py's pause: what survivors lost around a kill from outside."""

from __future__ import annotations

from tests.benchmarks import load


def _groups():
    return load("groups")


def test_a_kill_after_the_victims_share_went_through_is_a_pause_all_the_same():
    # Groups 0 and 1 commit a step every 0.1 s. Group 1 (pid 11) dies at 1.05, after its
    # share of step 11 went through and before it logged it: the survivor logs step 11 at
    # 1.1 (the old measure's "first step past the victim's last", 0.05 s after the kill),
    # then waits for the replacement (pid 12, back at 1.6) and commits step 12 at 1.65.
    rows = [(i / 10, i, slot, 10 + slot) for i in range(1, 11) for slot in (0, 1)]
    rows += [(1.1, 11, 0, 10), (1.6, 12, 1, 12), (1.65, 12, 0, 10), (1.75, 13, 0, 10),
             (1.75, 13, 1, 12)]
    assert _groups()._stall(sorted(rows), killed=1.05, victim=1, pid=11) == 1.65 - 1.1
