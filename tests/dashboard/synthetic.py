"""metrics.jsonl lines shaped like the ones shoal's step metrics write, made up quickly."""

from __future__ import annotations

import json
import math

PHASES = ("data", "compute", "comm", "optimizer", "other")


def step_line(step: int, world: int = 2, slow_rank: int | None = None,
              loss: float | None = None, now: float = 0.0, slower: float = 1.0) -> str:
    busy = [slower * 0.010 + (0.006 if r == slow_rank else 0.0) for r in range(world)]
    step_s = max(busy) + 0.002
    comm = [step_s - b for b in busy]
    if loss is None:
        loss = 2.0 * math.exp(-step / 300) + 0.1
    record = {"type": "step", "step": step, "epoch": 0, "time": now,
              "loss": loss if math.isfinite(loss) else None,  # as shoal writes it
              "lr": 0.1, "grad_norm": None, "step_time_s": step_s,
              "samples_per_s": 64 * world / step_s,
              "phases_s": {"data": 0.001 + (0.006 if slow_rank is not None else 0) / world,
                           "compute": 0.007, "comm": sum(comm) / world,
                           "optimizer": 0.001, "other": 0.001},
              "comm_bytes": 26_000.0, "rank_step_s": [step_s] * world, "rank_comm_s": comm}
    return json.dumps(record)


def window_line(first: int, last: int, world: int = 2, slow_rank: int | None = None,
                rss: float = 300e6, now: float = 0.0) -> str:
    ranks = [{"rank": r, "data": 0.007 if r == slow_rank else 0.001, "compute": 0.007,
              "comm": 0.002 if r == slow_rank else 0.008, "optimizer": 0.001, "other": 0.001,
              "step": 0.018, "cpu_percent": 95.0, "rss_bytes": rss, "gpu_util_percent": None,
              "gpu_memory_bytes": None} for r in range(world)]
    straggler = None if slow_rank is None else {
        "rank": slow_rank, "busy_s": 0.016, "median_busy_s": 0.013, "phase": "data",
        "phase_excess_s": 0.006, "spread_s": 0.006}
    return json.dumps({"type": "ranks", "steps": [first, last], "time": now, "ranks": ranks,
                       "straggler": straggler})


def event_line(kind: str, step: int, restart: int = 0, now: float = 0.0,
               memory_limit: int = 24 << 30) -> str:
    return json.dumps({"type": "event", "step": step, "time": now, "kind": kind,
                       "world_size": 2, "restart": restart, "memory_limit_bytes": memory_limit})


def run_lines(steps: int, every: int = 10, world: int = 2, slow_rank: int | None = None,
              start: int = 1) -> list[str]:
    """``steps`` steps from ``start`` with a per-rank window every ``every`` steps."""
    lines = []
    for step in range(start, start + steps):
        lines.append(step_line(step, world, slow_rank))
        if step % every == 0:
            lines.append(window_line(step - every + 1, step, world, slow_rank))
    return lines
