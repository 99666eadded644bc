"""examples/from_lightning.py: a Lightning user's script (early stopping, the best
checkpoints, the learning rate logged, a callback of one's own) ported to shoal, on 2
processes: it stops early, keeps its 2 best checkpoints beside the last ones, and its
callback sees the scheduler's learning rate at every step."""

from __future__ import annotations

import json

from tests.helpers import run_shoal

RUN_S = 150  # a hang guard, several times its length here


def test_the_ported_script_stops_early_and_keeps_its_best(tmp_path):
    out = run_shoal("run", "--nproc-per-node", "2", "examples/from_lightning.py",
                    str(tmp_path), timeout=RUN_S)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads((tmp_path / "result.json").read_text())
    step = saved["result"]["global_step"]
    assert saved["stopped"].startswith("early stopping: val_loss did not improve")
    assert f"shoal: stopping after step {step}: early stopping" in out.stderr
    assert step < 20 * 23  # (20 epochs of 23 steps: it stopped before the end)
    # The 2 best validations, best first, each one's checkpoint kept beside the newest.
    best = [(value, at) for value, at in saved["best"]]
    listed = json.loads((tmp_path / "checkpoints" / "best.json").read_text())["best"]
    assert [(e["val_loss"], e["step"]) for e in listed] == best and len(best) == 2
    assert best[0][0] <= best[1][0]
    kept = {p.name for p in (tmp_path / "checkpoints").glob("step_*")}
    assert {e["path"] for e in listed} <= kept
    # StepLR(50, 0.5): the rate the next step uses, as the callback saw it.
    assert saved["rates"] == {str(s): 3e-3 * 0.5 ** (s // 50) for s in range(10, step + 1, 10)}
    assert f"[rank0]: step {step}: val_loss " in out.stdout
