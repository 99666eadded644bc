"""The single-process reference for the model-parallel tests, and how results are compared.

One tiny GPT, one stream of batches, AdamW: trained in one process it gives the logits of
the first forward, the gradients of the first backward, the loss of every step and the
weights after the last step. A parallel run of the same model, data and seed must give the
same four things, up to rounding:

- logits, gradients and losses within ``RTOL`` (1e-5) of the largest entry of each tensor:
  the parallel runs add the same terms in another order (the row-parallel all-reduce sums
  two partial products; microbatches average per-microbatch means), a few float32 ulps.
  The gradients are compared because AdamW hides a wrongly scaled gradient: its step is
  the same for g and 2g.
- weights within ``RTOL`` of the largest entry plus 1% of one optimizer step (0.01 * LR).
  AdamW moves an element by about LR per step whatever the size of its gradient, so where
  a gradient is near zero its rounding error, not its size, decides the step. The bias of
  the attention keys has a zero gradient in exact arithmetic (softmax ignores a shift
  shared by all keys; its gradient is compared to zero instead), and a few other elements
  have gradients of 1e-9. AdamW's eps is 1e-6 rather than 1e-8 so that such gradients move
  their weight by a small fraction of a step (g / eps) instead of up to a whole one: the
  worst element then differs by less than 1e-3 of a step, an error in the parallel code by
  about a whole step or more.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shoal.examples.gpt import build_model, loss

MODEL = dict(vocab_size=256, seq_len=16, n_layer=4, n_head=4, d_model=32, seed=3)
BATCH, STEPS, LR = 8, 4, 1e-2
RTOL = 1e-5
WEIGHT_ATOL = 0.01 * LR
ZERO_GRADIENT = ("attn.k.bias",)  # exactly zero in exact arithmetic: compared to zero


def make_model() -> nn.Module:
    return build_model(**MODEL)


def batches(batch: int = BATCH, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token ids and targets, the same on every rank."""
    g = torch.Generator().manual_seed(11)
    shape = (batch, MODEL["seq_len"])
    return [(torch.randint(0, MODEL["vocab_size"], shape, generator=g),
             torch.randint(0, MODEL["vocab_size"], shape, generator=g)) for _ in range(steps)]


def make_optimizer(params) -> torch.optim.Optimizer:
    # eps: see the module docstring.
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


@dataclass
class Run:
    """What a training run is compared on."""

    logits: torch.Tensor | None  # first forward, (B, T, V); None where not available
    grads: dict[str, torch.Tensor]  # first backward, by the unsplit model's names
    losses: list[float]
    weights: dict[str, torch.Tensor]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain copy of a tensor or of a whole DTensor."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().clone()


def train_module(model: torch.nn.Module) -> Run:
    """The steps every comparison takes: AdamW over ``batches()``, first logits and
    gradients kept."""
    optimizer = make_optimizer(model.parameters())
    logits, grads, losses = None, {}, []
    for x, y in batches():
        out = model(x)
        value = loss(out, y)
        optimizer.zero_grad()
        value.backward()
        if logits is None:
            logits = out.detach().clone()
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(value.item())
    return Run(logits, grads, losses, {k: full(v) for k, v in model.state_dict().items()})


def train_pipeline(pipeline) -> Run:
    """``train_module`` for a pipeline stage: its own gradients and weights, the loss from
    the last stage, no logits."""
    optimizer = make_optimizer(pipeline.parameters())
    grads, losses = {}, []
    for x, y in batches():
        optimizer.zero_grad()
        value = pipeline.step(x, y)
        if not grads:
            grads = {n: full(p.grad) for n, p in pipeline.named_parameters()}
        optimizer.step()
        losses.append(value.item())
    return Run(None, grads, losses, {k: full(v) for k, v in pipeline.state_dict().items()})


def merge_stages(first: Run, last: Run) -> Run:
    """The whole model's run from its two pipeline stages' runs (which report one loss)."""
    assert first.losses == last.losses, "the last stage's loss did not reach the first"
    return Run(None, {**first.grads, **last.grads}, last.losses,
               {**first.weights, **last.weights})


@lru_cache(maxsize=1)
def reference_run() -> Run:
    return train_module(make_model())


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual - expected).abs().max().item()


def assert_matches(run: Run, ref: Run, what: str) -> None:
    """``run`` equals ``ref`` within the tolerances of the module docstring."""
    if run.logits is not None:
        scale = ref.logits.abs().max().item()
        assert _worst(run.logits, ref.logits) <= RTOL * scale, f"{what}: first logits differ"
    assert run.grads.keys() <= ref.grads.keys() and run.grads, f"{what}: no or unknown grads"
    for name, grad in run.grads.items():
        if name.endswith(ZERO_GRADIENT):
            scale = max(g.abs().max().item() for g in ref.grads.values())
            assert grad.abs().max().item() <= RTOL * scale, f"{what}: {name} grad not ~0"
            continue
        error, scale = _worst(grad, ref.grads[name]), ref.grads[name].abs().max().item()
        assert error <= RTOL * scale, f"{what}: grad of {name} off by {error / scale:.1e} rel"
    for step, (got, want) in enumerate(zip(run.losses, ref.losses, strict=True)):
        assert abs(got - want) <= RTOL * abs(want), f"{what}: loss at step {step}: {got} {want}"
    assert run.weights.keys() == ref.weights.keys(), f"{what}: different weight names"
    for name, weight in run.weights.items():
        want = ref.weights[name]
        error, allowed = _worst(weight, want), RTOL * want.abs().max().item() + WEIGHT_ATOL
        assert error <= allowed, f"{what}: {name} off by {error:.1e} (allowed {allowed:.1e})"
