"""trainer.compile on the GPU: under ddp the DDP wrapper is compiled whole, under fsdp each
block of the GPT before sharding; both train to the eager run's losses.

Inductor fuses the pointwise and normalisation kernels and so rounds differently from the
eager ones (on the CPU, tests/parallel/test_compile.py measures within 1e-5): the losses of
the same seed and data are allowed 1e-3 relative, which a wrongly compiled step (a missed
gradient, a stale weight) exceeds at once.
"""

from __future__ import annotations

import pytest
import torch

import shoal
from tests.gpu.common import (
    BACKEND,
    DEVICE,
    GPT,
    adamw,
    device_of,
    init,
    make_gpt,
    recording,
    tokens,
)

BATCH, STEPS = 8, 6
TOLERANCE = 1e-3


def _train(strategy: str, compile: bool) -> dict:
    model = make_gpt()
    losses: list[float] = []
    trainer = shoal.Trainer(model, adamw(model), loss_fn=recording(losses), strategy=strategy,
                            batch_size=BATCH, compile=compile, seed=GPT["seed"],
                            backend=BACKEND, progress=False)
    trainer.fit(tokens(), max_steps=STEPS)
    return {"losses": losses, "device": device_of(trainer),
            "ddp": isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel),
            "wrapper_compiled": trainer.model._compiled_call_impl is not None,
            "blocks_compiled": [b._compiled_call_impl is not None
                                for b in trainer.module.blocks]}


def _worker() -> dict:
    init()
    return {(strategy, compiled): _train(strategy, compiled)
            for strategy in ("ddp", "fsdp") for compiled in (False, True)}


@pytest.fixture(scope="module")
def results() -> dict:
    return shoal.spawn(_worker, nprocs=1)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_training_matches_eager(results, strategy):
    eager, compiled = results[strategy, False], results[strategy, True]
    assert compiled["device"] == DEVICE
    assert len(compiled["losses"]) == len(eager["losses"]) == STEPS
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=TOLERANCE)
    assert not any(eager["blocks_compiled"]) and not eager["wrapper_compiled"]
    if strategy == "ddp":  # the wrapper, so that its graph splits at the gradient buckets
        assert compiled["ddp"] and compiled["wrapper_compiled"]
    else:  # each block, before FSDP makes it a unit; the root stays eager for FSDP's hooks
        assert len(compiled["blocks_compiled"]) == GPT["n_layer"]
        assert all(compiled["blocks_compiled"]) and not compiled["wrapper_compiled"]
