"""A model with one block on a remote tier trains bit for bit like the same model all local
(CPU, loopback server), at 1 and 2 processes, through `shoal train`."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_shoal, states_equal
from tests.remote.runs import final_state, write_config


@pytest.mark.parametrize("nproc", [1, 2])
def test_remote_block_trains_bitwise_like_local(serve, tmp_path, nproc):
    server = serve()
    results = {}
    for name, endpoint in (("local", None), ("remote", server.endpoint)):
        config = write_config(tmp_path / name, endpoint)
        out = run_shoal("train", "--config", str(config), "--nproc-per-node", str(nproc))
        assert out.returncode == 0, out.stderr[-3000:]
        results[name] = final_state(tmp_path / name)
        results[name + "_metrics"] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert f"remote tier {server.endpoint} serves tests.remote.blocks:block on cpu" in out.stderr
    (local, local_meta), (remote, remote_meta) = results["local"], results["remote"]
    assert local_meta["global_step"] == remote_meta["global_step"] == 12
    assert any(k.startswith("block.fc1") for k in remote["model"])  # the same names
    assert states_equal(local, remote)
    def scores(metrics):
        return {k: v for k, v in metrics.items() if "loss" in k or "acc" in k}
    assert scores(results["local_metrics"]) == scores(results["remote_metrics"])
    assert "val_loss" in scores(results["local_metrics"])
    # The checkpoint names the remote tier it trained with.
    assert remote_meta["remote"] == {"block": {"endpoint": server.endpoint,
                                               "module": "tests.remote.blocks:block"}}
