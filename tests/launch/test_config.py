"""LaunchSpec validation and --nproc-per-node resolution."""

from __future__ import annotations

import os

import pytest
import torch

from shoal.errors import UsageError
from shoal.launch.config import LaunchSpec, resolve_nproc


def test_auto_is_one_process_per_gpu_or_core():
    expected = torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count()
    assert resolve_nproc("auto") == expected
    assert resolve_nproc("3") == 3
    with pytest.raises(UsageError, match="whole number, 'auto', 'cpu' or 'gpu'"):
        resolve_nproc("many")


@pytest.mark.parametrize("kwargs, message", [
    ({"nnodes": 2}, "--master-port is required"),
    ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "--node-rank must be in"),
    ({"master_port": 70000}, "--master-port must be in"),
    ({"max_restarts": -1}, "--max-restarts"),
])
def test_invalid_topology_is_refused(tmp_path, kwargs, message):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(UsageError, match=message):
        LaunchSpec(entry=str(script), **kwargs)
