"""The Trainer with tensor and pipeline parallelism (trainer.parallel tp / pp, alone and with
a sharded dp dimension) trains the small GPT of test_sharded to the losses, gradient norms
and weights of one process on the global batch (AdamW, clipping, accumulation), with the
tolerances stated there. Validation under a pipeline (a short last batch, padded) gives
the one-process loss."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import shoal
from shoal.errors import UsageError
from shoal.examples import gpt
from tests.helpers import max_rel_diff
from tests.parallel.test_sharded import (
    ACCUMULATE,
    CLIP,
    LOSS_TOLERANCE,
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
TWO = {  # W=2: the whole batch on one dp rank
    "tp": {"parallel": {"tp": 2}},
    "pp-gpipe": {"parallel": {"pp": 2}, "pipeline": {"schedule": "gpipe", "microbatches": 2}},
    "pp-1f1b+ac": {"parallel": {"pp": 2}, "activation_checkpointing": True},
}
FOUR = {  # W=4: 2-D meshes; the strategy says how the dp ranks share the split model
    "dp x tp (ddp)": {"parallel": {"tp": 2}},
    "dp x tp (fsdp)": {"parallel": {"tp": 2}, "strategy": "fsdp"},
    "dp x pp (ddp)": {"parallel": {"pp": 2}, "pipeline": {"microbatches": 2}},
    "dp x pp (zero2)": {"parallel": {"pp": 2}, "strategy": "zero2",
                        "pipeline": {"microbatches": 2}},
    "pp x tp": {"parallel": {"pp": 2, "tp": 2}, "pipeline": {"microbatches": 2}},
}
VALIDATION_SAMPLES = 7  # one batch of 8 short by one: padded for the pipeline


def _train(settings: dict) -> dict:
    """Train with the Trainer: per step the global batch's loss and the gradient norm; the
    whole weights of this rank's part of the model."""
    trainer_model = make_model()
    dp = shoal.world_size() // (settings["parallel"].get("tp", 1) *
                                settings["parallel"].get("pp", 1))
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
    state = get_model_state_dict(trainer.state_model,
                                 options=StateDictOptions(full_state_dict=True))
    x, y = make_dataset().tensors
    val = TensorDataset(x[:VALIDATION_SAMPLES], y[:VALIDATION_SAMPLES])
    return {"losses": losses.tolist(), "norms": norms, "val_loss_after": trainer.validate(val),
            "weights": {k: v.detach().clone() for k, v in state.items()}}


def _fresh_validation(settings: dict) -> float:
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), loss_fn=gpt.loss, batch_size=8,
                            progress=False, **settings)
    x, y = make_dataset().tensors
    val = TensorDataset(x[:VALIDATION_SAMPLES], y[:VALIDATION_SAMPLES])
    return trainer.validate(val)["val_loss"]


def _worker(runs: dict) -> dict:
    shoal.init("gloo")
    results = {name: _train(settings) for name, settings in runs.items()}
    if shoal.world_size() == 2:
        results["validation"] = _fresh_validation(TWO["pp-gpipe"])
        try:
            _fresh_validation({"parallel": {"pp": 2}, "precision": "fp16-mixed"})
        except UsageError as error:
            results["fp16 refused"] = str(error)
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
    mine = {k: v for k, v in weights.items() if not k.endswith(NO_GRADIENT)}
    diff = max_rel_diff(mine, {k: expected["weights"][k] for k in mine})
    assert diff <= WEIGHT_TOLERANCE, f"{name}: weights differ by {diff:.2e}"
    # The trained model validates alike on every rank (a pipeline's last stage shares it).
    assert len({r[name]["val_loss_after"]["val_loss"] for r in results}) == 1, name


@pytest.mark.parametrize("name", TWO)
def test_two_processes_match_one(two, name):
    _check(two, name)


@pytest.mark.parametrize("name", FOUR)
def test_two_dimensional_meshes_match_one(four, name):
    _check(four, name)


def test_pipeline_validation_pads_the_short_batch(two):
    x, y = make_dataset().tensors
    with torch.no_grad():
        expected = gpt.loss(make_model()(x[:VALIDATION_SAMPLES]), y[:VALIDATION_SAMPLES])
    for result in two:
        assert result["validation"] == pytest.approx(expected.item(), rel=1e-6)


def test_pipeline_refuses_fp16(two):
    assert all("use 'bf16-mixed' with pp > 1" in r["fp16 refused"] for r in two)
