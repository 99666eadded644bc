"""Periodic weight averaging: local_sgd and diloco against DDP and against each other."""

from __future__ import annotations

import pytest
import torch

import shoal
from tests.helpers import max_rel_diff
from tests.training.reference import SEED, make_dataset, make_model

BATCH, STEPS = 8, 12


# Every run of this file: (settings, SGD momentum). One job of 2 processes runs them all.
RUNS = {
    "ddp": ({}, 0.0),
    "local every step": ({"strategy": "local_sgd", "local_sgd": {"period": 1}}, 0.0),
    "local every 4": ({"strategy": "local_sgd", "local_sgd": {"period": 4}}, 0.0),
    "diloco": ({"strategy": "diloco", "diloco": {"period": 3}}, 0.9),
    "diloco again": ({"strategy": "diloco", "diloco": {"period": 3}}, 0.9),
    # Outer SGD with lr 1 and no momentum moves the shared weights to the replicas' mean.
    "diloco plain outer": ({"strategy": "diloco",
                            "diloco": {"period": 3, "outer_lr": 1.0, "outer_momentum": 0.0}},
                           0.9),
    "local every 3": ({"strategy": "local_sgd", "local_sgd": {"period": 3}}, 0.9),
    # 12 steps with period 5: the last two steps were taken apart; fit meets once more.
    "local every 5": ({"strategy": "local_sgd", "local_sgd": {"period": 5}}, 0.9),
    "diloco every 5": ({"strategy": "diloco", "diloco": {"period": 5}}, 0.9),
}


def _fit_all() -> dict[str, dict[str, torch.Tensor]]:
    shoal.init("gloo")
    results = {}
    for name, (settings, momentum) in RUNS.items():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        trainer = shoal.Trainer(model, optimizer, batch_size=BATCH, seed=SEED, progress=False,
                                **settings)
        trainer.fit(make_dataset(), max_steps=STEPS)
        results[name] = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, torch.Tensor]]]:
    return shoal.spawn(_fit_all, nprocs=2)


def test_local_sgd_every_step_with_plain_sgd_is_ddp(runs):
    every_4 = [r["local every 4"] for r in runs]
    for rank, result in enumerate(runs):
        # Averaging w - lr*g_r equals stepping with the averaged g, up to rounding.
        assert max_rel_diff(result["local every step"], result["ddp"]) <= 1e-6
        # 12 steps end on a meeting: the replicas agree, and differ from DDP's.
        for key, value in every_4[rank].items():
            assert torch.equal(value, every_4[0][key])
        assert max_rel_diff(every_4[rank], result["ddp"]) > 1e-4


def test_diloco_is_deterministic_and_is_local_sgd_without_outer_momentum(runs):
    for result in runs:
        first, second = result["diloco"], result["diloco again"]
        assert all(torch.equal(first[k], second[k]) for k in first)
        assert max_rel_diff(result["diloco plain outer"], result["local every 3"]) <= 1e-6
        assert max_rel_diff(first, result["local every 3"]) > 1e-4  # momentum matters


@pytest.mark.parametrize("name", ["local every 5", "diloco every 5"])
def test_training_ends_with_one_model(runs, name):
    for key, value in runs[1][name].items():
        assert torch.equal(value, runs[0][name][key]), (name, key)
