"""What deserves a user's attention in a run: checked on every poll, said once each.

- a run that stopped writing (and, where its ranks' heartbeats are visible, which rank
  stopped first);
- a loss that is not finite;
- throughput that dropped well below the run's own median;
- a rank's memory near the limit of its machine (or cgroup);
- a rank's memory that keeps growing window after window.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from shoal.dashboard.run import RunWatch
from shoal.runtime import heartbeat


@dataclass(frozen=True)
class AlertSettings:
    silence_s: float = 60.0
    """A run that has not ended and wrote nothing for this long is said to be silent."""
    drop: float = 0.5
    """Throughput of the recent steps below this fraction of the run's median."""
    recent: int = 20
    memory_near: float = 0.9
    """A rank's resident memory above this fraction of the memory limit."""
    growth_windows: int = 6
    growth: float = 0.2
    """Resident memory that rose in each of the last ``growth_windows`` windows, by this
    fraction in all."""


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def check(run: RunWatch, settings: AlertSettings, now: float | None = None) -> dict[str, str]:
    """The alerts that hold for ``run`` now: a key (stable while the cause lasts) each."""
    now = time.time() if now is None else now
    alerts: dict[str, str] = {}
    name = run.name
    if run.events and not run.ended and now - run.last_growth > settings.silence_s:
        quiet = now - run.last_growth
        where = f" after step {run.last_step}" if run.last_step is not None else ""
        laggard = _oldest_beat(run)
        alerts["silent"] = (f"{name}: no metrics for {quiet:.0f} s{where}" +
                            (f"; {laggard}" if laggard else ""))
    bad = [p["step"] for p in run.points if p.get("loss", 0) is None]  # null: not finite
    if bad:
        alerts[f"nonfinite:{bad[0]}"] = (f"{name}: the loss is not finite at step {bad[0]}" +
                                         (f" (and {len(bad) - 1} later points)"
                                          if len(bad) > 1 else ""))
    rates = [p["samples_per_s"] for p in run.points if p.get("samples_per_s")]
    if len(rates) >= 4 * settings.recent:
        recent = statistics.median(rates[-settings.recent:])
        usual = statistics.median(rates[:-settings.recent])
        if recent < settings.drop * usual:
            alerts["throughput"] = (f"{name}: throughput fell to {recent:,.0f} samples/s over "
                                    f"the last {settings.recent} points, {recent / usual:.0%} "
                                    f"of the run's median {usual:,.0f}")
    limit = next((e["memory_limit_bytes"] for e in reversed(run.events)
                  if e.get("memory_limit_bytes")), None)
    if run.windows and limit:
        for row in run.windows[-1]["ranks"]:
            rss = row.get("rss_bytes") or 0
            if rss > settings.memory_near * limit:
                alerts[f"memory:{row['rank']}"] = (
                    f"{name}: rank {row['rank']} holds {_mb(rss)}, {rss / limit:.0%} of the "
                    f"{_mb(limit)} its machine allows")
    n = settings.growth_windows
    if len(run.windows) > n:
        last = run.windows[-n - 1:]
        for rank in range(len(last[-1]["ranks"])):
            rss = [w["ranks"][rank].get("rss_bytes") or 0 if rank < len(w["ranks"]) else 0
                   for w in last]
            rising = all(b > a for a, b in zip(rss, rss[1:], strict=False))
            if rising and rss[0] and rss[-1] > (1 + settings.growth) * rss[0]:
                alerts[f"growth:{rank}"] = (
                    f"{name}: rank {rank}'s memory grew in each of the last {n} windows, "
                    f"from {_mb(rss[0])} to {_mb(rss[-1])} (steps {last[0]['steps'][1]}-"
                    f"{last[-1]['steps'][1]})")
    return alerts


def _oldest_beat(run: RunWatch) -> str | None:
    """The rank whose heartbeat is oldest, where the launcher keeps them in the run dir."""
    beats = []
    for path in sorted(run.dir.glob("logs/*/heartbeats/rank*.beat")):
        got = heartbeat.read(str(path))
        if got is not None and got[1] >= 0:
            beats.append((got[0], got[1], path))
    if len(beats) < 2:
        return None
    when, step, path = min(beats)
    newest = max(b[0] for b in beats)
    if newest - when < 1:
        return None
    return (f"rank {path.stem.removeprefix('rank')} beat last at step {step}, "
            f"{newest - when:.0f} s before the others")
