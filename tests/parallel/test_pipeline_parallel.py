"""Pipeline parallel at pp=2 trains like one process; bad settings fail before any change."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import shoal
from shoal.errors import UsageError
from shoal.examples.gpt import build_model, loss
from shoal.parallel.pipeline_parallel import PipelineConfig, apply_pp, split_blocks
from tests.parallel.gpt_reference import (
    MODEL,
    Run,
    assert_matches,
    batches,
    make_model,
    merge_stages,
    reference_run,
    train_pipeline,
)

SETTINGS = [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]


def _train(schedule: str, microbatches: int, mesh) -> Run:
    pipeline = apply_pp(make_model(), mesh, PipelineConfig(schedule=schedule,
                                                           microbatches=microbatches), loss)
    return train_pipeline(pipeline)


def _errors(mesh) -> dict[str, str]:
    """The message of each invalid setting, after checking that nothing was changed."""
    errors = {}
    one_block = build_model(vocab_size=256, seq_len=16, n_layer=1, n_head=4, d_model=32)
    with pytest.raises(UsageError) as failed:
        apply_pp(one_block, mesh, PipelineConfig(schedule="gpipe", microbatches=2), loss)
    assert len(one_block.blocks) == 1 and one_block.head is not None
    errors["stages"] = str(failed.value)

    with pytest.raises(UsageError) as failed:
        apply_pp(make_model(), mesh, PipelineConfig(schedule="1f1b", microbatches=1), loss)
    errors["1f1b"] = str(failed.value)

    pipeline = apply_pp(make_model(), mesh, PipelineConfig(schedule="gpipe", microbatches=4),
                        loss)
    before = {k: v.clone() for k, v in pipeline.state_dict().items()}
    x, y = batches(batch=6, steps=1)[0]
    with pytest.raises(UsageError) as failed:
        pipeline.step(x, y)
    assert all(p.grad is None for p in pipeline.parameters())
    assert all(torch.equal(v, before[k]) for k, v in pipeline.state_dict().items())
    errors["batch"] = str(failed.value)

    # Groups of one rank: DDP's construction must not reach the other stage.
    alone = [dist.new_group([r]) for r in range(mesh.size())][mesh.get_local_rank()]
    with pytest.raises(UsageError) as failed:
        apply_pp(make_model(), mesh, PipelineConfig(), loss,
                 parallelize_stage=lambda stage: DistributedDataParallel(stage,
                                                                         process_group=alone))
    errors["ddp"] = str(failed.value)
    return errors


def _loads_whole_model_state(mesh) -> bool:
    """A stage takes its entries from the unsplit model's state dict."""
    pipeline = apply_pp(build_model(**{**MODEL, "seed": 99}), mesh, PipelineConfig(), loss)
    whole = make_model().state_dict()
    pipeline.load_state_dict(whole)
    return all(torch.equal(v, whole[k]) for k, v in pipeline.state_dict().items())


def _worker() -> dict:
    shoal.init("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    runs = {f"{s}/{m}": _train(s, m, mesh) for s, m in SETTINGS}
    return {"runs": runs, "errors": _errors(mesh), "loads": _loads_whole_model_state(mesh)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return shoal.spawn(_worker, nprocs=2)


@pytest.mark.parametrize("schedule, microbatches", SETTINGS)
def test_pp2_matches_single_process(results, schedule, microbatches):
    key = f"{schedule}/{microbatches}"
    first, last = (r["runs"][key] for r in results)
    # Each stage holds its own blocks under the unsplit model's names.
    assert not first.weights.keys() & last.weights.keys()
    assert "tok_emb.weight" in first.weights and "head.weight" in last.weights
    assert {k.split(".")[1] for k in first.weights if k.startswith("blocks.")} == {"0", "1"}
    # The last stage's loss reaches the first stage (merge_stages checks it).
    assert_matches(merge_stages(first, last), reference_run(), f"pp=2 {key}")


def test_invalid_settings_fail_with_one_line(results):
    for errors in results:
        assert errors["errors"]["stages"] == (
            "pipeline of 2 stages for a model of 1 blocks: each stage needs at least one "
            "block; use pp <= 1")
        assert "at least as many microbatches as stages" in errors["errors"]["1f1b"]
        assert "multiple of 4" in errors["errors"]["batch"]
        assert "apply_replicate" in errors["errors"]["ddp"]
        assert all("\n" not in message for message in errors["errors"].values())


def test_stage_loads_its_part_of_the_whole_model_state(results):
    assert all(result["loads"] for result in results)


def test_blocks_are_split_evenly_earlier_stages_first():
    assert split_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(UsageError, match="use pp <= 2"):
        split_blocks(2, 3)


def test_microbatches_must_be_positive():
    with pytest.raises(ValueError, match="microbatches"):
        PipelineConfig(microbatches=0)
