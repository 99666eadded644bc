"""W ranks with batch B train to the same weights as one process with batch W*B."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shoal
from tests.helpers import max_rel_diff
from tests.training.reference import (
    SEED,
    make_dataset,
    make_model,
    make_optimizer,
    reference_weights,
)

BATCH = 8
STEPS = 12  # at W=3 this crosses an epoch boundary (10 steps per epoch)
TOLERANCE = 1e-5


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_both_ways() -> dict[str, dict[str, torch.Tensor]]:
    """On each rank: train once with the Trainer and once with the piecewise Harness."""
    shoal.init("gloo")
    dataset = make_dataset()

    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=SEED,
                            progress=False)
    trainer.fit(dataset, max_steps=STEPS)

    harness = shoal.Harness(seed=SEED)
    model2 = make_model()
    wrapped, opt = harness.setup(model2, make_optimizer(model2))
    loader = harness.setup_dataloader(dataset, batch_size=BATCH)
    step, epoch = 0, 0
    while step < STEPS:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = harness.to_device((x, y))
            with harness.autocast():
                loss = F.cross_entropy(wrapped(x), y)
            harness.backward(loss)
            harness.step(opt)
            step += 1
            if step == STEPS:
                break
        epoch += 1
    return {"trainer": _state(trainer.module), "harness": _state(model2)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ddp_matches_single_process_with_global_batch(world):
    results = shoal.spawn(_train_both_ways, nprocs=world)
    expected = reference_weights(global_batch=world * BATCH, steps=STEPS)
    for rank, result in enumerate(results):
        for api in ("trainer", "harness"):
            diff = max_rel_diff(result[api], expected)
            assert diff <= TOLERANCE, f"{api} at W={world} rank {rank}: rel diff {diff:.2e}"
    # Every rank holds the very same replica.
    for result in results[1:]:
        for api in ("trainer", "harness"):
            assert all(torch.equal(result[api][k], results[0][api][k]) for k in result[api])


def test_reference_is_sensitive_to_batch_size():
    # Guard against a vacuous comparison: a different global batch gives different weights.
    assert max_rel_diff(reference_weights(16, STEPS), reference_weights(8, STEPS)) > 1e-3
