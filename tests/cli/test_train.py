"""The main job: `shoal train` on the digits config, 2 processes, real data, >= 95 %."""

from __future__ import annotations

import json
import os
import re

import yaml

from tests.helpers import REPO, run_shoal


def test_digits_config_trains_to_95_percent(tmp_path):
    run_dir = tmp_path / "digits"
    out = run_shoal("train", "--config", "examples/digits.yaml", "--nproc-per-node", "2",
                    f"run.dir={run_dir}", timeout=170)
    assert out.returncode == 0, out.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val_accuracy"] >= 0.95, metrics
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    # Builders are looked up beside the config, then in the directory it ran from.
    assert saved["run"] == {"dir": str(run_dir), "nproc_per_node": 2,
                            "code_paths": [os.path.join(REPO, "examples"), REPO]}
    # Progress and epoch reports come from rank 0 only.
    progress = [line for line in out.stdout.splitlines() if "samples/s" in line]
    assert progress and all(line.startswith("[rank0]:") for line in progress)
    assert re.search(r"\[rank0\]: .*val_accuracy \d+\.\d+%", out.stdout)
    assert "[rank1]: epoch" not in out.stdout
    # Step metrics of both ranks in the run directory, and the end-of-run table.
    records = [json.loads(line) for line in
               (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert steps[-1]["step"] == len(steps) and steps[-1]["samples_per_s"] > 0
    assert all(len(r["ranks"]) == 2 for r in records if r["type"] == "ranks")
    assert any((run_dir / "tensorboard").iterdir())
    assert "[rank0]: shoal: time per step by rank" in out.stdout


def test_env_report_names_versions_and_interfaces():
    out = run_shoal("env")
    assert out.returncode == 0, out.stderr
    assert "torch=" in out.stdout and "interface lo" in out.stdout and "gloo=True" in out.stdout
