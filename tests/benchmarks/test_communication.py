"""The communication benchmark runs end to end (a tiny budget; its figures are not checked)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_communication_benchmark_prints_its_table():
    out = subprocess.run(
        [sys.executable, "benchmarks/communication.py", "--epochs", "1", "--repeats", "1",
         "--hidden", "32", "--only", "topk-1%,diloco-H32"],
        cwd=REPO, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    for name in ("ddp", "topk-1%", "diloco-H32"):
        assert name in rows, out.stdout
    assert rows["ddp"][3] == "1.0x"  # the baseline's reduction against itself
