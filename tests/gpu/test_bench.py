"""`shoal bench allreduce` on the GPU: one process, NCCL, messages from 1 KiB to 1 MiB."""

from __future__ import annotations

import json

import pytest

from shoal.bench.allreduce import sizes
from tests.gpu.common import BACKEND, DEVICE
from tests.helpers import run_shoal


def test_allreduce_bandwidth_on_the_gpu(tmp_path):
    table = tmp_path / "allreduce.json"
    out = run_shoal("bench", "allreduce", "--nproc-per-node", "1", "--max-size", "1M",
                    "--iters", "5", "--json", str(table), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"all-reduce, fp32, 1 processes, backend {BACKEND}, device {DEVICE}" in out.stdout
    result = json.loads(table.read_text())
    assert (result["backend"], result["world_size"]) == (BACKEND, 1)
    assert [r["bytes"] for r in result["rows"]] == sizes(1024, 2**20, 4)
    for row in result["rows"]:
        assert row["seconds"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert row["algbw_GBps"] > 0
        # Bus bandwidth counts what a ring moves between ranks, 2(n-1)/n: none at n = 1.
        assert row["busbw_GBps"] == 0
