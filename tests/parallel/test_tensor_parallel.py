"""Tensor parallel at tp=2 trains like one process; bad plans fail before any change."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import shoal
from shoal.errors import UsageError
from shoal.examples.gpt import build_model
from shoal.parallel.tensor_parallel import TensorParallelConfig, apply_tp, transformer_plan
from tests.parallel.gpt_reference import (
    assert_matches,
    make_model,
    reference_run,
    train_module,
)

# The ready plan, with and without the vocabulary split, and a user's plan that splits the
# attention only (a plan need not cover every layer).
PLANS = ["blocks", "blocks+vocab", "custom"]


def _parallelize(model, mesh, which: str):
    if which == "custom":
        plan = {"blocks.*.attn.[qkv]": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel()}
        return apply_tp(model, mesh, plan=plan)
    return apply_tp(model, mesh, TensorParallelConfig(shard_vocab=which == "blocks+vocab"))


def _train(which: str, mesh) -> dict:
    model = _parallelize(make_model(), mesh, which)
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    return {"run": train_module(model), "sharded": sharded}


def _errors(mesh) -> dict[str, str]:
    """The message of each invalid setting, after checking that nothing was changed."""
    errors = {}
    cases = {
        "heads": (dict(n_head=3, d_model=24), {}),
        "vocab": (dict(vocab_size=255), {"config": TensorParallelConfig(shard_vocab=True)}),
        "key": ({}, {"plan": {"blocks.*.atn.q": ColwiseParallel()}}),
        "both": ({}, {"plan": transformer_plan(), "config": TensorParallelConfig()}),
    }
    for case, (shape, kwargs) in cases.items():
        model = build_model(**{"seq_len": 16, "n_layer": 1, "d_model": 32, **shape})
        with pytest.raises(UsageError) as failed:
            apply_tp(model, mesh, **kwargs)
        assert not any(isinstance(p, DTensor) for p in model.parameters()), case
        errors[case] = str(failed.value)
    return errors


def _worker() -> dict:
    shoal.init("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return {"runs": {which: _train(which, mesh) for which in PLANS}, "errors": _errors(mesh)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return shoal.spawn(_worker, nprocs=2)


@pytest.mark.parametrize("which", PLANS)
def test_tp2_matches_single_process(results, which):
    for rank, result in enumerate(results):
        assert_matches(result["runs"][which]["run"], reference_run(), f"tp=2 {which} rank {rank}")


def test_plans_shard_what_they_say(results):
    runs = results[0]["runs"]
    per_block = {"attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj"}
    linears = {f"blocks.{i}.{m}.{p}" for i in range(4) for m in per_block
               for p in ("weight", "bias")}
    assert set(runs["blocks"]["sharded"]) == linears
    assert set(runs["blocks+vocab"]["sharded"]) == linears | {"tok_emb.weight", "head.weight"}
    assert set(runs["custom"]["sharded"]) == {n for n in linears if ".attn." in n}


def test_invalid_settings_fail_with_one_line(results):
    errors = results[0]["errors"]
    assert errors["heads"] == ("blocks.0.attn has 3 attention heads, which tensor parallelism "
                               "cannot split over 2 ranks: use a tp degree that divides 3, or "
                               "a model with a multiple of 2 heads")
    assert "vocabulary (255) over 2 ranks" in errors["vocab"]
    assert errors["key"] == ("tensor-parallel plan key 'blocks.*.atn.q' names no module of GPT; "
                             "names look like 'blocks.0.attn.q'")
    assert "both a plan and a TensorParallelConfig" in errors["both"]
    assert all("\n" not in message for message in errors.values())
    assert results[1]["errors"] == errors


def test_plan_keys_are_patterns_over_module_names():
    plan = transformer_plan()
    assert set(plan) == {f"blocks.*.{m}" for m in
                         ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")}
    assert isinstance(plan["blocks.*.attn.proj"], RowwiseParallel)
