"""The profiler window: `shoal train --profile-steps A-B` writes one torch.profiler trace
per rank (a Chrome trace: the model's kernels and the gradients' all-reduce), says where,
and changes nothing of the run; a window that cannot be is one line."""

from __future__ import annotations

import json

import pytest

from shoal.training.config import parse_window
from tests.helpers import run_shoal, run_shoal_in_process

RUN_S = 120  # a hang guard for each 2-process run, several times its length here


def test_a_trace_per_rank_and_the_run_unchanged(tmp_path):
    common = ["train", "--config", "examples/digits.yaml", "--nproc-per-node", "2",
              "trainer.epochs=1", "trainer.progress=false"]
    plain = run_shoal(*common, f"run.dir={tmp_path}/plain", timeout=RUN_S)
    profiled = run_shoal(*common, f"run.dir={tmp_path}/profiled", "--profile-steps", "3-5",
                         timeout=RUN_S)
    assert plain.returncode == 0 and profiled.returncode == 0, profiled.stderr[-3000:]
    folder = tmp_path / "profiled" / "profile"
    assert f"[rank0]: shoal: profiled steps 3 to 5: {folder}/*.pt.trace.json, one per rank" \
        in profiled.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.pt.trace.json",
                                                        "rank1.pt.trace.json"]
    for rank in (0, 1):
        names = {e.get("name") for e in json.loads(
            (folder / f"rank{rank}.pt.trace.json").read_text())["traceEvents"]}
        assert "aten::addmm" in names  # the model's kernels
        assert any("allreduce" in (name or "") for name in names)  # the gradients' (gloo's)
    ours, theirs = (json.loads((tmp_path / run / "metrics.json").read_text())
                    for run in ("profiled", "plain"))
    assert {k: ours[k] for k in ("train_loss", "val_loss", "val_accuracy")} == \
        {k: theirs[k] for k in ("train_loss", "val_loss", "val_accuracy")}


@pytest.mark.parametrize("given, window", [("20-25", (20, 25)), ("7", (7, 7)), (4, (4, 4)),
                                           ([2, 3], (2, 3)), (None, None)])
def test_a_window_is_first_to_last(given, window):
    assert parse_window(given) == window


def test_a_window_that_cannot_be_is_one_line(tmp_path):
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml",
                               f"run.dir={tmp_path}", "--profile-steps", "9-3")
    assert out.returncode == 2
    assert out.stderr == ("shoal train: error: invalid configuration: trainer.profile_steps: "
                          "'9-3': the first step must be at least 1 and not after the last\n")
