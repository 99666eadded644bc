"""The Trainer with tensor and pipeline parallelism (trainer.parallel tp / pp, alone and with
a dp dimension) trains the small GPT of test_sharded to the losses, gradient norms
and weights of one process on the global batch (AdamW, clipping, accumulation), with the
tolerances stated there. Validation under a pipeline (a short last batch, padded) gives
the one-process loss."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shoal
from shoal.errors import UsageError
from shoal.examples import gpt
from tests.parallel.test_sharded import (
    ACCUMULATE,
    CLIP,
    LOSS_TOLERANCE,
    MIXED_LOSS_TOLERANCE,
    NO_GRADIENT,
    NORM_TOLERANCE,
    SEED,
    STEPS,
    WEIGHT_TOLERANCE,
    make_dataset,
    make_model,
    make_optimizer,
    reference,
)

GLOBAL_BATCH = 16  # test_sharded's reference: 2 ranks x 4 samples x 2 micro-batches
# Weights: test_sharded's tolerance of the largest entry, plus 1 % of one AdamW step.
# AdamW moves an element by about lr a step whatever its gradient's size, so where a
# gradient nearly cancels (the first MLP layer at init) its rounding, which depends on
# the order of the sums (microbatches, shards), moves the weight by a small fraction of a
# step: measured up to 8e-6 = 0.08 % of a step. A scaling error moves it by whole steps.
LR, ADAM_STEP_FRACTION = 1e-2, 0.01
TWO = {  # W=2: the whole batch on one dp rank
    "tp": {"parallel": {"tp": 2}},
    "tp, user plan": {"parallel": {"tp": 2}, "tp_plan": "attention only"},
    "pp-gpipe": {"parallel": {"pp": 2}, "pipeline": {"schedule": "gpipe", "microbatches": 2}},
    "pp-1f1b+ac": {"parallel": {"pp": 2}, "activation_checkpointing": True},
}
FOUR = {  # W=4: 2-D meshes; the strategy says how the dp ranks share the split model
    "dp x tp (ddp)": {"parallel": {"tp": 2}},
    "dp x tp (fsdp)": {"parallel": {"tp": 2}, "strategy": "fsdp"},
    "dp x pp (ddp)": {"parallel": {"pp": 2}, "pipeline": {"microbatches": 2}},
    "dp x pp (fsdp)": {"parallel": {"pp": 2}, "strategy": "fsdp",
                       "pipeline": {"microbatches": 2, "schedule": "gpipe"}},
    "dp x pp (zero2)": {"parallel": {"pp": 2}, "strategy": "zero2",
                        "pipeline": {"microbatches": 2}},
    "pp x tp": {"parallel": {"pp": 2, "tp": 2}, "pipeline": {"microbatches": 2}},
}
MIXED = {  # W=2, autocast: losses near fp32's (test_sharded's tolerance)
    "tp bf16": {"parallel": {"tp": 2}, "precision": "bf16-mixed"},
    "pp bf16": {"parallel": {"pp": 2}, "precision": "bf16-mixed",
                "pipeline": {"schedule": "gpipe", "microbatches": 2}},
}
VALIDATION_SAMPLES = 7  # one batch of 8 short by one: padded for the pipeline


def _train(settings: dict) -> dict:
    """Train with the Trainer: per step the global batch's loss and the gradient norm; the
    whole weights of this rank's part of the model."""
    trainer_model = make_model()
    dp = shoal.world_size() // (settings["parallel"].get("tp", 1) *
                                settings["parallel"].get("pp", 1))
    if settings.get("tp_plan"):  # a plan of the user's own: split attention, not the MLP
        settings = {**settings, "tp_plan": {"blocks.*.attn.[qkv]": ColwiseParallel(),
                                            "blocks.*.attn.proj": RowwiseParallel()}}
    trainer = shoal.Trainer(trainer_model, make_optimizer(trainer_model), loss_fn=gpt.loss,
                            batch_size=GLOBAL_BATCH // ACCUMULATE // dp,
                            accumulate_grad_batches=ACCUMULATE, seed=SEED, progress=False,
                            clip_grad_norm=CLIP, **settings)
    micro: list[torch.Tensor] = []  # this rank's micro-batch losses, then their dp mean
    norms: list[float] = []
    trainer.optimizer.register_step_post_hook(
        lambda *_: norms.append(trainer.harness.last_grad_norm.item()))
    if trainer.pipeline:  # the pipeline returns each micro-batch's loss on every stage
        step = trainer.model.step
        trainer.model.step = lambda *a, **k: micro.append(step(*a, **k)) or micro[-1]
    else:
        def record(outputs, targets):
            loss = gpt.loss(outputs, targets)
            micro.append(loss.detach())
            return loss
        trainer.loss_fn = record
    trainer.fit(make_dataset(), max_steps=STEPS)
    losses = torch.stack(micro).view(STEPS, ACCUMULATE).mean(dim=1)
    torch.distributed.all_reduce(losses)  # every rank has its dp share's loss
    losses /= shoal.world_size()
    split = sorted(n for n, p in trainer.state_model.named_parameters()
                   if isinstance(p, DTensor) and p.placements[-1].is_shard())
    state = get_model_state_dict(trainer.state_model,
                                 options=StateDictOptions(full_state_dict=True))
    return {"losses": losses.tolist(), "norms": norms, "split": split,
            "val_loss_after": trainer.validate(_validation_set())["val_loss"],
            "weights": {k: v.detach().clone() for k, v in state.items()}}


def _validation_set() -> TensorDataset:
    x, y = make_dataset().tensors
    return TensorDataset(x[:VALIDATION_SAMPLES], y[:VALIDATION_SAMPLES])


def _fresh_validation(settings: dict) -> float:
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), loss_fn=gpt.loss, batch_size=8,
                            progress=False, **settings)
    return trainer.validate(_validation_set())["val_loss"]


def _worker(runs: dict) -> dict:
    shoal.init("gloo")
    results = {name: _train(settings) for name, settings in runs.items()}
    if shoal.world_size() == 2:
        results.update({name: _train(settings) for name, settings in MIXED.items()})
        results["validation"] = _fresh_validation(TWO["pp-gpipe"])
        try:
            _fresh_validation({"parallel": {"pp": 2}, "precision": "fp16-mixed"})
        except UsageError as error:
            results["fp16 refused"] = str(error)
        model = make_model()
        trainer = shoal.Trainer(model, make_optimizer(model), loss_fn=gpt.loss, batch_size=8,
                                progress=False, parallel={"tp": 2})
        sharded = DataLoader(make_dataset(), batch_size=8, sampler=DistributedSampler(
            make_dataset(), num_replicas=2, rank=shoal.rank()))
        try:
            trainer.fit(sharded, max_steps=1)
        except UsageError as error:
            results["loader refused"] = str(error)
    return results


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return shoal.spawn(_worker, args=(TWO,), nprocs=2)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return shoal.spawn(_worker, args=(FOUR,), nprocs=4)


def _check(results: list[dict], name: str) -> None:
    expected = reference()
    weights: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results):
        run = result[name]
        for step, (got, want) in enumerate(zip(run["losses"], expected["losses"], strict=True)):
            assert abs(got - want) <= LOSS_TOLERANCE * want, (name, rank, step, got, want)
        for step, (got, want) in enumerate(zip(run["norms"], expected["norms"], strict=True)):
            assert abs(got - want) <= NORM_TOLERANCE * want, (name, rank, step, got, want)
        for key, value in run["weights"].items():  # a stage's part, or the whole model
            assert key not in weights or torch.equal(weights[key], value), (name, key)
            weights[key] = value
    assert weights.keys() == expected["weights"].keys(), f"{name}: parts do not add up"
    for key, value in weights.items():
        if key.endswith(NO_GRADIENT):
            continue
        want = expected["weights"][key]
        error = (value - want).abs().max().item()
        allowed = WEIGHT_TOLERANCE * want.abs().max().item() + ADAM_STEP_FRACTION * LR
        assert error <= allowed, f"{name}: {key} off by {error:.1e} (allowed {allowed:.1e})"
    # The trained model's validation loss is the one-process model's, on every rank.
    want = _reference_validation()
    for result in results:
        assert result[name]["val_loss_after"] == pytest.approx(want, rel=1e-4), name


def _reference_validation() -> float:
    model = make_model()
    model.load_state_dict(reference()["weights"])
    x, y = _validation_set().tensors
    with torch.no_grad():
        return gpt.loss(model(x), y).item()


@pytest.mark.parametrize("name", TWO)
def test_two_processes_match_one(two, name):
    _check(two, name)


@pytest.mark.parametrize("name", FOUR)
def test_two_dimensional_meshes_match_one(four, name):
    _check(four, name)


def test_a_user_plan_splits_what_it_names(two):
    for result in two:
        split = result["tp, user plan"]["split"]
        assert split and all(".attn." in name for name in split), split
        assert any(".mlp." in name for name in result["tp"]["split"])


def test_pipeline_validation_pads_the_short_batch(two):
    x, y = make_dataset().tensors
    with torch.no_grad():
        expected = gpt.loss(make_model()(x[:VALIDATION_SAMPLES]), y[:VALIDATION_SAMPLES])
    for result in two:
        assert result["validation"] == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("name", MIXED)
def test_mixed_precision_stays_close(two, name):
    expected = reference()["losses"]
    for result in two:
        for step, (got, want) in enumerate(zip(result[name]["losses"], expected, strict=True)):
            assert abs(got - want) <= MIXED_LOSS_TOLERANCE * want, (name, step, got, want)


def test_a_loader_split_by_the_user_is_refused(two):
    # Its samples would differ between the tp ranks, which must read the same batches.
    assert all("DistributedSampler: pass a map-style Dataset" in r["loader refused"]
               for r in two)


def test_model_parallelism_refuses_fp16(two):
    assert all("'fp16-mixed' cannot be combined with tensor or pipeline" in r["fp16 refused"]
               for r in two)
