"""Meshes of two dimensions at W=4 (dp x tp, pp x dp, pp x tp) train like one process.

With dp, each dp rank gets its half of every batch and the gradients are averaged over dp,
so the run equals one process on the whole batch: the same reference as the 1-D tests.
The dp dimension is ``apply_fsdp`` (torch's FSDP2: each block one unit, then the root),
which first gives every dp rank the first one's parameters: after tensor parallelism
these are DTensors, and each tp coordinate's piece is what is sent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shoal
from shoal.examples.gpt import loss
from shoal.parallel.fsdp import apply_fsdp
from shoal.parallel.pipeline_parallel import PipelineConfig, apply_pp
from shoal.parallel.tensor_parallel import apply_tp
from tests.parallel.gpt_reference import (
    BATCH,
    Run,
    assert_matches,
    make_model,
    merge_stages,
    reference_run,
    train_module,
    train_pipeline,
)

DP = 2


def _my_half(tensor: torch.Tensor, dp_rank: int) -> torch.Tensor:
    share = BATCH // DP
    return tensor[dp_rank * share:(dp_rank + 1) * share]


def _mean_over(value: torch.Tensor, mesh) -> float:
    dist.all_reduce(value, group=mesh.get_group())
    return value.item() / mesh.size()


def _dp_tp() -> dict:
    """TP inside each pair of ranks, then FSDP over the dp pairs (torch's documented order)."""
    mesh = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tp(make_model(), mesh["tp"])
    apply_fsdp(model, mesh["dp"], blocks=list(model.blocks))
    dp_rank = mesh["dp"].get_local_rank()
    run = train_module(model, shard=lambda t: _my_half(t, dp_rank),
                       reduce=lambda value: _mean_over(value, mesh["dp"]))
    # Each dp rank saw half the batch: its logits are compared with that half of the
    # reference's, not as a whole.
    logits, run.logits = run.logits, None
    return {"run": run, "logits": logits, "dp_rank": dp_rank}


def _dp_pp() -> Run:
    """Pipeline stages, each sharded with FSDP over its dp pair."""
    mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))

    def parallelize(stage: nn.Module) -> nn.Module:
        return apply_fsdp(stage, mesh["dp"], blocks=list(stage.blocks.values()))

    config = PipelineConfig(schedule="1f1b", microbatches=2)
    pipeline = apply_pp(make_model(), mesh["pp"], config, loss, parallelize_stage=parallelize)
    dp_rank = mesh["dp"].get_local_rank()
    return train_pipeline(pipeline, shard=lambda t: _my_half(t, dp_rank),
                          reduce=lambda value: _mean_over(value, mesh["dp"]))


def _pp_tp() -> Run:
    """Pipeline stages, each split by tensor parallelism over its tp pair."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    config = PipelineConfig(schedule="gpipe", microbatches=2)
    pipeline = apply_pp(make_model(), mesh["pp"], config, loss,
                        parallelize_stage=lambda stage: apply_tp(stage, mesh["tp"]))
    return train_pipeline(pipeline)


def _worker() -> dict:
    shoal.init("gloo")
    return {"dp_tp": _dp_tp(), "pp_dp": _dp_pp(), "pp_tp": _pp_tp()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return shoal.spawn(_worker, nprocs=4)


@pytest.mark.timeout(300)
def test_dp2_tp2_matches_single_process(results):
    ref = reference_run()
    for rank, result in enumerate(results):
        dp_tp = result["dp_tp"]
        assert_matches(dp_tp["run"], ref, f"dp=2 x tp=2 rank {rank}")
        half = _my_half(ref.logits, dp_tp["dp_rank"])
        assert (dp_tp["logits"] - half).abs().max() <= 1e-5 * half.abs().max()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("other", ["dp", "tp"])
def test_pp2_with_dp2_or_tp2_matches_single_process(results, other):
    # Mesh ("pp", other) of shape (2, 2): ranks 0, 1 hold stage 0, ranks 2, 3 stage 1.
    for first, last in ((results[0], results[2]), (results[1], results[3])):
        run = merge_stages(first[f"pp_{other}"], last[f"pp_{other}"])
        assert_matches(run, reference_run(), f"pp=2 x {other}=2")
