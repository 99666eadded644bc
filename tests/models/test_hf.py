"""transformers models (GPT-2, Llama, BERT built from tiny configs) train under shoal at 2
processes to the losses and weights of one process with the global batch: ddp and fsdp
(blocks found from the model's own layer classes), activation checkpointing, bf16; a
``datasets.Dataset`` is split by shoal's sampler and resumes mid-epoch bitwise."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

import shoal
from tests.helpers import max_rel_diff
from tests.models.hf_models import (
    LAYERS,
    hf_dataset,
    make_model,
    make_optimizer,
    reference,
    samples,
)

WORLD, BATCH, STEPS = 2, 4, 4  # global batch 8; 48 samples: 6 steps an epoch
# As in tests/parallel/test_sharded.py: two half-batch means averaged instead of one mean,
# float32 rounding of the losses (~1e-7), which AdamW, dividing each gradient by its own
# RMS, passes into the weights where a gradient nearly cancels (measured 1.4e-4 after 4
# steps, GPT-2's first MLP weight).
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-6, 5e-4
BF16_LOSS_TOLERANCE = 1e-2  # 8 bits of mantissa in the forward, as for shoal's own GPT
RUNS = {
    "gpt2/ddp": ("gpt2", {"strategy": "ddp"}),
    "gpt2/fsdp": ("gpt2", {"strategy": "fsdp"}),
    "llama/ddp": ("llama", {"strategy": "ddp"}),
    "llama/fsdp": ("llama", {"strategy": "fsdp"}),
    "bert/ddp": ("bert", {"strategy": "ddp"}),
    "bert/fsdp": ("bert", {"strategy": "fsdp"}),
    "gpt2/ddp+ac": ("gpt2", {"strategy": "ddp", "activation_checkpointing": True}),
    "llama/fsdp+ac": ("llama", {"strategy": "fsdp", "activation_checkpointing": True}),
}


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _train(name: str, data, steps: int = STEPS, **settings) -> tuple[shoal.Trainer, dict]:
    """Train with the Trainer on dict batches, the model's own loss; this rank's micro-batch
    losses (read from the model's outputs) and the whole weights."""
    model = make_model(name)
    losses: list[float] = []
    model.register_forward_hook(
        lambda module, _, outputs: losses.append(outputs.loss.item()) if module.training
        else None)
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=3,
                            progress=False, **settings)
    trainer.fit(data, max_steps=steps)
    return trainer, {"losses": losses, "weights": _full_weights(trainer.model)}


def _layers_sharded(trainer: shoal.Trainer, name: str) -> int:
    """The model's layers that FSDP made units of their own."""
    return sum(1 for m in trainer.module.modules()
               if isinstance(m, FSDPModule) and m is not trainer.module
               and LAYERS[name] in type(m).__name__)


def _resumed(directory: str) -> dict:
    """A datasets.Dataset: 4 steps straight, saving at step 2 (mid-epoch); then a new run
    resumed from step 2 to step 4."""
    _, straight = _train("gpt2", hf_dataset(), checkpoint_dir=directory, checkpoint_every=2)
    _, resumed = _train("gpt2", hf_dataset(), resume=f"{directory}/step_{2:09d}")
    return {"straight": straight, "resumed": resumed}


def _worker(directory: str) -> dict:
    shoal.init("gloo")
    results = {}
    for run, (name, settings) in RUNS.items():
        trainer, results[run] = _train(name, samples(), **settings)
        results[run]["sharded_layers"] = _layers_sharded(trainer, name)
    # A sharded model validates in lockstep: 5 samples, batch 4, so ranks hold 3 and 2.
    model = make_model("gpt2")
    validating = shoal.Trainer(model, make_optimizer(model), strategy="fsdp",
                               batch_size=BATCH, progress=False)
    results["validation"] = validating.validate(samples(5))["val_loss"]
    results["bf16"] = _train("gpt2", samples(), precision="bf16-mixed")[1]
    results["datasets"] = _train("gpt2", hf_dataset())[1]
    results["resume"] = _resumed(directory)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return shoal.spawn(_worker, nprocs=WORLD, args=(str(tmp_path_factory.mktemp("ckpt")),))


def _step_losses(per_rank: list[list[float]]) -> list[float]:
    """Each step's loss over the global batch: the mean of the ranks' micro-batch losses."""
    return [sum(losses) / len(losses) for losses in zip(*per_rank, strict=True)]


def _with_gradient(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without the attention key biases: they get no gradient in exact arithmetic (softmax
    ignores a shift that every key shares), so their updates are rounding noise turned into
    steps of size lr by Adam. GPT-2 keeps them in the middle third of c_attn.bias."""
    kept = {k: v for k, v in weights.items() if not k.endswith("key.bias")}
    for k, v in kept.items():
        if k.endswith("c_attn.bias"):
            third = len(v) // 3
            kept[k] = torch.cat([v[:third], v[2 * third:]])
    return kept


def _close(run: dict, expected: dict) -> float:
    weights = _with_gradient(run["weights"])
    return max_rel_diff(weights, {k: v for k, v in _with_gradient(expected["weights"]).items()
                                  if k in weights})


@pytest.mark.parametrize("run", RUNS)
def test_matches_one_process(results, run):
    name, settings = RUNS[run]
    expected = reference(name, STEPS, WORLD * BATCH)
    losses = _step_losses([r[run]["losses"] for r in results])
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, expected["losses"], strict=True)):
        assert abs(got - want) <= LOSS_TOLERANCE * want, (run, step, got, want)
    for rank_result in results:
        assert _close(rank_result[run], expected) <= WEIGHT_TOLERANCE, run
    if settings["strategy"] == "fsdp":  # each layer its own unit, with no setting
        assert all(r[run]["sharded_layers"] == 2 for r in results), run


def test_activation_checkpointing_recomputes_the_same_numbers(results):
    for rank_result in results:
        for run, base in (("gpt2/ddp+ac", "gpt2/ddp"), ("llama/fsdp+ac", "llama/fsdp")):
            assert rank_result[run]["losses"] == rank_result[base]["losses"], run
            assert all(torch.equal(v, rank_result[base]["weights"][k])
                       for k, v in rank_result[run]["weights"].items()), run


def test_bf16_mixed_stays_close(results):
    expected = reference("gpt2", STEPS, WORLD * BATCH)["losses"]
    losses = _step_losses([r["bf16"]["losses"] for r in results])
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(got - want) <= BF16_LOSS_TOLERANCE * want, (step, got, want)


def test_a_datasets_dataset_is_a_dataset_like_any_other(results):
    # The same samples as dicts in a list: shoal's sampler splits both alike.
    for rank_result in results:
        assert rank_result["datasets"]["losses"] == rank_result["gpt2/ddp"]["losses"]


def test_datasets_run_resumes_mid_epoch_bitwise(results):
    for rank_result in results:
        straight, resumed = rank_result["resume"]["straight"], rank_result["resume"]["resumed"]
        assert resumed["losses"] == straight["losses"][2:]
        assert all(torch.equal(v, straight["weights"][k]) for k, v in resumed["weights"].items())


def test_sharded_validation_counts_each_sample_once(results):
    batch = torch.utils.data.default_collate(samples(5))
    with torch.no_grad():
        expected = make_model("gpt2").eval()(**batch).loss.item()
    for rank_result in results:
        assert rank_result["validation"] == pytest.approx(expected, rel=1e-5)
