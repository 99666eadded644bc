"""The remote tier's server on the GPU (its default device when it has one), trainers on the
CPU: the same training as all local within float tolerance (CUDA kernels differ from CPU
ones), and the GPU server's step beside the CPU one."""

from __future__ import annotations

import torch

from tests.helpers import max_rel_diff, run_shoal
from tests.remote.conftest import Server
from tests.remote.runs import final_state, write_config


def test_block_on_the_gpu_server_trains_like_local(tmp_path):
    server = Server()  # --device left out: cuda here
    try:
        assert torch.cuda.is_available()
        results = {}
        for name, endpoint in (("local", None), ("remote", server.endpoint)):
            # The trainers on the CPU (gloo): two of them, and one GPU, which the server holds.
            config = write_config(tmp_path / name, endpoint, backend="gloo")
            out = run_shoal("train", "--config", str(config), "--nproc-per-node", "2")
            assert out.returncode == 0, out.stderr[-3000:]
            results[name] = final_state(tmp_path / name)[0]["model"]
        assert "serves tests.remote.blocks:block on cuda" in out.stderr
        assert max_rel_diff(results["remote"], results["local"]) < 1e-4
    finally:
        server.close()
