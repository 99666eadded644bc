"""Which rank holds the others back, and in which phase.

In synchronous data parallel every rank's step takes as long as the slowest one's: the
others wait for it in the gradient all-reduce. So the straggler is not the rank with the
longest step but the one with the most *busy* time (step minus communication wait), and the
phase that made it slow is the one where it exceeds the median rank the most.
"""

from __future__ import annotations

import statistics

BUSY_PHASES = ("data", "compute", "optimizer", "other")


def find_straggler(ranks: list[dict[str, float]], threshold: float = 0.2) -> dict | None:
    """``ranks``: each rank's mean seconds per step by phase (and 'step').

    Returns the straggler (rank, its busy time, the median's, the phase and by how much it
    exceeds the median rank there, the spread of busy time) when its busy time exceeds the
    median rank's by more than ``threshold`` of the median step time; else None.
    """
    if len(ranks) < 2:
        return None
    busy = [r["step"] - r["comm"] for r in ranks]
    median_busy = statistics.median(busy)
    median_step = statistics.median(r["step"] for r in ranks)
    slowest = max(range(len(ranks)), key=busy.__getitem__)
    if busy[slowest] - median_busy <= threshold * median_step:
        return None
    excess = {p: ranks[slowest][p] - statistics.median(r[p] for r in ranks)
              for p in BUSY_PHASES}
    phase = max(excess, key=excess.__getitem__)
    return {"rank": slowest, "busy_s": busy[slowest], "median_busy_s": median_busy,
            "phase": phase, "phase_excess_s": excess[phase],
            "spread_s": busy[slowest] - min(busy)}


def describe(straggler: dict, first_step: int, last_step: int,
             labels: dict[str, str] | None = None) -> str:
    s = straggler
    phase = (labels or {}).get(s["phase"], s["phase"])
    return (f"straggler at steps {first_step}-{last_step}: rank {s['rank']} is busy "
            f"{s['busy_s'] * 1e3:.1f} ms/step against {s['median_busy_s'] * 1e3:.1f} ms for "
            f"the median rank; its {phase} phase takes {s['phase_excess_s'] * 1e3:.1f} "
            "ms/step more (the other ranks wait for it in communication)")
