"""The memory benchmark runs end to end (a tiny GPT; only its own accounting is checked)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_memory_benchmark_prints_its_table():
    out = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--params", "1e5", "--d-model", "32",
         "--n-head", "2", "--worlds", "2", "--strategies", "ddp,fsdp,tp,pp", "--steps", "2",
         "--tokens", "8", "--repeats", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in ("ddp", "fsdp", "tp", "pp")}
    assert set(rows) == {"ddp", "fsdp", "tp", "pp"}, out.stdout
    # ddp holds every byte it is meant to: 16 bytes a parameter; fsdp, tensor and pipeline
    # parallel less (about a half).
    assert rows["ddp"][8] == "1.00", out.stdout
    for split in ("fsdp", "tp", "pp"):
        assert float(rows[split][6]) < float(rows["ddp"][6]), (split, out.stdout)
