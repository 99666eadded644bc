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


def test_a_plugin_of_our_own_is_loaded_from_the_config_and_trains_the_same(tmp_path):
    results = {}
    for name, endpoint in (("local", None), ("plugin", "127.0.0.1:1")):
        config = write_config(tmp_path / name, endpoint,
                              {"tier_plugin": "tests.remote.plugin:factory"})
        out = run_shoal("train", "--config", str(config))
        assert out.returncode == 0, out.stderr[-3000:]
        results[name] = final_state(tmp_path / name)
    assert "remote tier 127.0.0.1:1 serves tests.remote.blocks:block on cpu" in out.stderr
    assert results["plugin"][1]["remote"] == {"block": {"kind": "in-process"}}
    assert states_equal(results["local"][0], results["plugin"][0])
    # A factory that returns something else is refused before any worker starts.
    config = write_config(tmp_path / "broken", "127.0.0.1:1",
                          {"tier_plugin": "tests.remote.plugin:broken"})
    out = run_shoal("train", "--config", str(config))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "shoal train: error: remote_hardware.tier_plugin tests.remote.plugin:broken returned "
        "object, which lacks endpoint, capabilities, healthy, call, state_dict, "
        "load_state_dict, close of shoal.remote.RemoteTier")
