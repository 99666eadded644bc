"""`shoal bench allreduce` and `shoal bench scaling` at small sizes."""

from __future__ import annotations

import json

import pytest

from shoal.bench.allreduce import parse_size, sizes
from tests.helpers import run_shoal, run_shoal_in_process


def test_allreduce_bandwidth_table(tmp_path):
    out = run_shoal("bench", "allreduce", "--nproc-per-node", "2", "--max-size", "256K",
                    "--iters", "5", "--json", str(tmp_path / "allreduce.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "all-reduce, fp32, 2 processes, backend gloo" in out.stdout
    result = json.loads((tmp_path / "allreduce.json").read_text())
    assert [r["bytes"] for r in result["rows"]] == sizes(1024, 256 * 1024, 4)
    for row in result["rows"]:
        assert row["seconds"] > 0
        # Bus bandwidth is algorithm bandwidth x 2(n-1)/n: equal at n = 2.
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)


def test_sizes_parse():
    assert parse_size("4K") == 4096 and parse_size("256M") == 256 * 2**20
    assert parse_size("100") == 100
    bad = run_shoal_in_process("bench", "allreduce", "--max-size", "lots")
    assert bad.returncode == 2 and "not a size" in bad.stderr


def test_scaling_at_one_and_two_processes(tmp_path):
    out = run_shoal("bench", "scaling", "--config", "examples/digits.yaml", "--max-nproc",
                    "2", "--steps", "20", "--warmup", "5", "--out", str(tmp_path), timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["world_size"] for r in rows] == [1, 2]
    assert rows[0]["speedup"] == 1.0 and rows[0]["efficiency"] == 1.0
    for row in rows:
        assert row["samples_per_s"] > 0 and 0 <= row["comm_share"] < 1
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["world_size"])
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup" in out.stdout and "efficiency" in out.stdout
