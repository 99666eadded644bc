"""benchmarks/recovery.py's figures without kills: pairs that alternate which runs first,
and a `shoal train` run's step rate read from its metrics."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmarks import load


def _recovery():
    return load("recovery")


def test_the_pairs_alternate_which_runs_first(tmp_path):
    ran: list[str] = []

    def run(kind: str) -> Path:
        ran.append(kind)
        out = tmp_path / f"{len(ran)}"
        out.mkdir()
        return out

    readings = _recovery()._alternated("live exact", 3, run, lambda out: int(out.name))
    assert ran == ["baseline", "live exact", "live exact", "baseline", "baseline",
                   "live exact"]
    assert readings == [(2, 1), (3, 4), (6, 5)]  # (the mode's, DDP's) in every pair


def test_a_train_runs_rate_is_its_mean_step_past_the_fifth(tmp_path):
    rows = [{"type": "step", "step": s, "step_time_s": 5.0 if s <= 5 else 0.25}
            for s in range(1, 9)]
    rows[6]["step_time_s"] = 0.5  # step 7
    rows.append({"type": "validation", "step": 8, "val_loss": 3.25})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    assert _recovery()._train_figures(tmp_path) == (3.0, 3.25)  # 1 / mean(.25, .5, .25)
