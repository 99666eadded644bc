"""Topology flags against a detected scheduler: the flags win, the scheduler fills the rest."""

from __future__ import annotations

import os

import pytest

from shoal.cli.main import build_parser
from shoal.cli.run import detect_cluster, spec_from_args
from shoal.errors import UsageError
from tests.clusters.test_detect import HYDRA, PYTORCHJOB_WORKER, SLURM_2x1


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def _spec(monkeypatch, environ: dict[str, str], *argv: str):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "PMI", "PET_", "MASTER_", "RANK", "WORLD_SIZE",
                           "LOCAL_", "TORCHELASTIC_", "JOB_COMPLETION_INDEX", "SHOAL_")):
            monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    args = build_parser()[0].parse_args(["run", *argv])
    cluster = detect_cluster(args)
    return cluster, spec_from_args(args, args.entry, args.args, args.module, cluster=cluster)


def test_nothing_detected_keeps_the_old_defaults(monkeypatch, script):
    cluster, spec = _spec(monkeypatch, {}, script)
    assert cluster is None
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.master_port,
            spec.nproc_per_node) == (1, 0, "127.0.0.1", None, 1)


def test_scheduler_fills_what_flags_leave_out(monkeypatch, script):
    _, spec = _spec(monkeypatch, SLURM_2x1, "--nproc-per-node", "3", script)
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.master_port,
            spec.nproc_per_node) == (2, 1, "node001", 21234, 3)


def test_given_flags_win(monkeypatch, script):
    _, spec = _spec(monkeypatch, SLURM_2x1, "--nnodes", "3", "--node-rank", "2",
                    "--master-port", "29999", script)
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.master_port) == (
        3, 2, "node001", 29999)
    _, spec = _spec(monkeypatch, PYTORCHJOB_WORKER, script)
    assert spec.nproc_per_node == 4  # the PyTorchJob's nprocPerNode when no flag is given
    _, spec = _spec(monkeypatch, PYTORCHJOB_WORKER, "--nproc-per-node", "2", script)
    assert spec.nproc_per_node == 2


def test_all_topology_flags_skip_detection(monkeypatch, script):
    # Several MPI nodes and no MASTER_ADDR would be an error; full flags never look.
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        _spec(monkeypatch, HYDRA, script)
    cluster, spec = _spec(monkeypatch, HYDRA, "--nnodes", "1", "--node-rank", "0",
                          "--master-addr", "127.0.0.1", "--master-port", "29400", script)
    assert cluster is None and spec.master_port == 29400


def test_master_addr_flag_takes_the_place_of_the_variable(monkeypatch, script):
    cluster, _ = _spec(monkeypatch, HYDRA, "--master-addr", "node01", script)
    assert (cluster.per_process, cluster.master_addr, cluster.rank) == (True, "node01", 4)
