"""W ranks with batch B train to the same weights as one process with batch W*B.

Every case of one world size runs in one job (the ``runs`` fixture), so the module starts 6
processes, not one group per case; each test asserts on its own case.
"""

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
UNEVEN = {2: (4, 3), 3: (8, 1)}  # world: (batch, accumulate)
VALIDATION_SIZES = {2: (7,), 3: (7, 2)}  # world: sizes of the validation sets


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _every_case(world: int) -> dict:
    """On each rank of a group of ``world``: every case of this module at that size."""
    shoal.init("gloo")
    result = {"both": _train_both_ways()}
    if world in UNEVEN:
        result["uneven"] = _train_uneven(*UNEVEN[world], n_samples=100, steps=7)
    for n_val in VALIDATION_SIZES.get(world, ()):
        result[("validate", n_val)] = _validate(n_val)
    return result


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """Each world size's job: every rank's results, by rank."""
    return {world: shoal.spawn(_every_case, nprocs=world, args=(world,)) for world in (1, 2, 3)}


def _train_both_ways() -> dict[str, dict[str, torch.Tensor]]:
    """Train once with the Trainer and once with the piecewise Harness."""
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
def test_ddp_matches_single_process_with_global_batch(runs, world):
    results = [run["both"] for run in runs[world]]
    expected = reference_weights(global_batch=world * BATCH, steps=STEPS)
    for rank, result in enumerate(results):
        for api in ("trainer", "harness"):
            diff = max_rel_diff(result[api], expected)
            assert diff <= TOLERANCE, f"{api} at W={world} rank {rank}: rel diff {diff:.2e}"
    # Every rank holds the very same replica.
    for result in results[1:]:
        for api in ("trainer", "harness"):
            assert all(torch.equal(result[api][k], results[0][api][k]) for k in result[api])


def _train_uneven(batch: int, accumulate: int, n_samples: int, steps: int):
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=batch, seed=SEED,
                            accumulate_grad_batches=accumulate, progress=False)
    trainer.fit(make_dataset(n_samples), max_steps=steps)
    return _state(trainer.module)


@pytest.mark.parametrize("world, batch, accumulate", [(w, *case) for w, case in UNEVEN.items()])
def test_dataset_size_not_divisible_by_global_batch(runs, world, batch, accumulate):
    # 100 samples: the epoch ends on a short global batch (4 samples), which ranks share
    # unequally; 7 steps cross into the next epoch.
    n_samples, steps = 100, 7
    assert UNEVEN[world] == (batch, accumulate)
    results = [run["uneven"] for run in runs[world]]
    expected = reference_weights(world * batch * accumulate, steps, n_samples=n_samples)
    for rank, weights in enumerate(results):
        diff = max_rel_diff(weights, expected)
        assert diff <= TOLERANCE, f"W={world} rank {rank}: rel diff {diff:.2e}"


def _validate(n_val: int):
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=2, progress=False)
    return trainer.validate(make_dataset(n_val))


@pytest.mark.parametrize("world, n_val",
                         [(w, n) for w, sizes in VALIDATION_SIZES.items() for n in sizes])
def test_validation_is_over_the_whole_set_once(runs, world, n_val):
    # 2 samples on 3 ranks: one rank has none, and must still take part.
    x, y = make_dataset(n_val).tensors
    with torch.no_grad():
        out = make_model()(x)
    expected_loss = F.cross_entropy(out, y).item()
    expected_acc = (out.argmax(1) == y).sum().item() / n_val
    for metrics in [run[("validate", n_val)] for run in runs[world]]:
        assert metrics["val_loss"] == pytest.approx(expected_loss, rel=1e-6)
        assert metrics["val_accuracy"] == pytest.approx(expected_acc, abs=1e-12)


def test_reference_is_sensitive_to_batch_size():
    # Guard against a vacuous comparison: a different global batch gives different weights.
    assert max_rel_diff(reference_weights(16, STEPS), reference_weights(8, STEPS)) > 1e-3
