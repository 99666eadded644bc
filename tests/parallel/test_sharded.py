"""ddp, zero1, zero2 and fsdp at W=2 train a small GPT to the same losses, gradient norms
and weights as one process with the global batch (AdamW, clipping, accumulation)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import shoal
from shoal.examples import gpt
from tests.helpers import max_rel_diff

WORLD, BATCH, ACCUMULATE, STEPS = 2, 4, 2, 5  # 16 samples a step, 64 an epoch: 4 steps
N_SAMPLES, SEQ, VOCAB, SEED, CLIP = 64, 8, 33, 5, 0.5
# Against one process: each rank averages its half of the batch and the halves are
# averaged, in another order than one process sums: float32 rounding, ~1e-7 of the losses
# and gradient norms (measured 1.3e-7 and 1.6e-7).
LOSS_TOLERANCE = 1e-6
NORM_TOLERANCE = 1e-6
# Weights after 5 AdamW steps, relative to each tensor's largest entry: Adam divides each
# gradient by its own RMS, so where a gradient is a near-cancellation (the attention query
# at init, attention nearly uniform) its rounding error passes whole into the update:
# measured 1.4e-5, the same for ddp as for every sharded strategy.
WEIGHT_TOLERANCE = 1e-4
# The key bias gets no gradient in exact arithmetic (softmax ignores a shift that every
# key shares): its updates are rounding noise turned into steps of size lr by Adam.
NO_GRADIENT = "attn.k.bias"

RUNS = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "fsdp": {"strategy": "fsdp"},
    "fsdp+ac": {"strategy": "fsdp", "activation_checkpointing": True},
    "fsdp+offload": {"strategy": "fsdp", "fsdp": {"cpu_offload": True}},
    "ddp+ac": {"strategy": "ddp", "activation_checkpointing": True},
}
# Without clipping the sharded strategies compute the very same numbers as ddp at W=2
# (a sum of two halves does not depend on the order); with clipping, the norm of sharded
# gradients is summed shard by shard, another order.
UNCLIPPED = ("ddp", "zero2", "fsdp")
# fsdp computing in bf16 (parameters gathered in bf16, gradients reduced in fp32) or with
# fp16 autocast: 8 or 11 bits of mantissa, losses within ~1e-3 of fp32's.
MIXED_LOSS_TOLERANCE = 1e-2
VALIDATION_SIZES = (3, 1)  # 2 + 1 batches on the two ranks; 1 + none


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_model() -> torch.nn.Module:
    # vocab 33: the embedding and head rows do not split evenly over 2 ranks (FSDP pads).
    return gpt.build_model(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=16,
                           seed=SEED)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference(steps: int = STEPS, global_batch: int = WORLD * BATCH * ACCUMULATE) -> dict:
    """One process, plain torch, the global batch: losses, gradient norms, weights."""
    x, y = make_dataset().tensors
    model = make_model()
    optimizer = make_optimizer(model)
    losses, norms = [], []
    epoch = 0
    while len(losses) < steps:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch))
        for first in range(0, len(x), global_batch):
            idx = perm[first:first + global_batch]
            loss = gpt.loss(model(x[idx]), y[idx])
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return {"losses": losses, "norms": norms,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors on every rank, whatever the strategy (FSDP's are gathered)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def train(settings: dict, steps: int = STEPS, **more) -> tuple[shoal.Trainer, dict]:
    """Train with the Trainer; per step: this rank's micro-batch losses, the norm."""
    micro_losses: list[float] = []

    def loss_fn(outputs, targets):
        loss = gpt.loss(outputs, targets)
        micro_losses.append(loss.item())
        return loss

    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), loss_fn=loss_fn, batch_size=BATCH,
                            accumulate_grad_batches=ACCUMULATE,
                            seed=SEED, progress=False, **{"clip_grad_norm": CLIP, **settings},
                            **more)
    norms: list[float] = []
    trainer.optimizer.register_step_post_hook(lambda *_: norms.append(
        float("nan") if trainer.harness.last_grad_norm is None
        else trainer.harness.last_grad_norm.item()))
    trainer.fit(make_dataset(), max_steps=steps)
    return trainer, {"micro_losses": micro_losses, "norms": norms,
                     "weights": full_weights(trainer.model)}


def _no_sync_keeps_gradients_local() -> bool:
    """Under fsdp, a backward inside no_sync reduce-scatters nothing: no sharded gradient
    appears until a backward outside it."""
    harness = shoal.Harness(strategy="fsdp", seed=SEED)
    model, _ = harness.setup(make_model())
    x, y = make_dataset().tensors
    with harness.no_sync(model):
        harness.backward(gpt.loss(model(x[:2]), y[:2]))
    inside = all(p.grad is None for p in model.parameters())
    harness.backward(gpt.loss(model(x[2:4]), y[2:4]))
    after = all(p.grad is not None for p in model.parameters())
    return inside and after


def _validate(n_samples: int) -> float:
    """fsdp's validation over ``n_samples`` with one sample a batch: the ranks have unequal
    numbers of batches (or none), yet every forward is collective."""
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), loss_fn=gpt.loss, strategy="fsdp",
                            batch_size=1, progress=False)
    x, y = make_dataset().tensors
    return trainer.validate(TensorDataset(x[:n_samples], y[:n_samples]))["val_loss"]


def _worker() -> dict:
    shoal.init("gloo")
    results = {name: train(settings)[1] for name, settings in RUNS.items()}
    results["unclipped"] = {name: train({"strategy": name, "clip_grad_norm": None})[1]["weights"]
                            for name in UNCLIPPED}
    results["bf16"] = train({"strategy": "fsdp", "fsdp": {"mixed_precision": True}})[1]
    results["fp16"] = train({"strategy": "fsdp", "precision": "fp16-mixed"})[1]
    results["no_sync"] = _no_sync_keeps_gradients_local()
    results["validation"] = {n: _validate(n) for n in VALIDATION_SIZES}
    return results


def _step_losses(per_rank: list[list[float]]) -> list[float]:
    """Each step's loss over the global batch: the mean of every rank's micro-batches."""
    flat = [sum(r[i] for r in per_rank) / WORLD for i in range(len(per_rank[0]))]
    return [sum(flat[i:i + ACCUMULATE]) / ACCUMULATE for i in range(0, len(flat), ACCUMULATE)]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return shoal.spawn(_worker, nprocs=WORLD)


@pytest.mark.parametrize("name", RUNS)
def test_matches_single_process(results, name):
    expected = reference()
    runs = [r[name] for r in results]
    losses = _step_losses([r["micro_losses"] for r in runs])
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, expected["losses"], strict=True)):
        assert abs(got - want) <= LOSS_TOLERANCE * abs(want), (name, step, got, want)
    for run in runs:
        for step, (got, want) in enumerate(zip(run["norms"], expected["norms"], strict=True)):
            assert abs(got - want) <= NORM_TOLERANCE * want, (name, step, got, want)
        weights = {k: v for k, v in run["weights"].items() if not k.endswith(NO_GRADIENT)}
        diff = max_rel_diff(weights, {k: expected["weights"][k] for k in weights})
        assert diff <= WEIGHT_TOLERANCE, f"{name}: weights differ by {diff:.2e}"
    assert all(torch.equal(runs[0]["weights"][k], runs[1]["weights"][k])
               for k in runs[0]["weights"]), f"{name}: the ranks' models differ"


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bitwise_where_the_math_is_the_same(results):
    for result in results:
        # zero1 all-reduces like ddp and steps the same elementwise AdamW on each rank's
        # share; activation checkpointing recomputes the very same forward; offloading to
        # the CPU on a CPU moves nothing.
        for name, base in (("zero1", "ddp"), ("ddp+ac", "ddp"), ("fsdp+ac", "fsdp"),
                           ("fsdp+offload", "fsdp")):
            assert _same(result[name]["weights"], result[base]["weights"]), name
            assert result[name]["micro_losses"] == result[base]["micro_losses"], name
        unclipped = result["unclipped"]
        for name in UNCLIPPED[1:]:
            assert _same(unclipped[name], unclipped["ddp"]), f"{name} without clipping"


def test_no_sync_defers_the_reduce_scatter(results):
    assert all(r["no_sync"] for r in results)


@pytest.mark.parametrize("run", ["bf16", "fp16"])
def test_mixed_precision_stays_close(results, run):
    # bf16: fsdp.mixed_precision; fp16: autocast with a gradient scaler that sees the
    # overflow of any rank's shard (ShardedGradScaler).
    expected = reference()["losses"]
    losses = _step_losses([r[run]["micro_losses"] for r in results])
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(got - want) <= MIXED_LOSS_TOLERANCE * want, (step, got, want)


@pytest.mark.parametrize("n_samples", VALIDATION_SIZES)
def test_validation_with_uneven_shares(results, n_samples):
    x, y = make_dataset().tensors
    with torch.no_grad():
        expected = gpt.loss(make_model()(x[:n_samples]), y[:n_samples]).item()
    for result in results:
        assert result["validation"][n_samples] == pytest.approx(expected, rel=1e-6)
