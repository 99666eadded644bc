"""Periodic weight averaging: local_sgd and diloco against DDP and against each other."""

from __future__ import annotations

import torch

import shoal
from tests.helpers import max_rel_diff
from tests.training.reference import SEED, make_dataset, make_model

BATCH, STEPS = 8, 12


def _fit(settings: dict, momentum: float = 0.0) -> dict[str, torch.Tensor]:
    shoal.init("gloo")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    trainer = shoal.Trainer(model, optimizer, batch_size=BATCH, seed=SEED, progress=False,
                            **settings)
    trainer.fit(make_dataset(), max_steps=STEPS)
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


def test_local_sgd_every_step_with_plain_sgd_is_ddp():
    ddp = shoal.spawn(_fit, nprocs=2, args=({},))
    every_step = shoal.spawn(_fit, nprocs=2, args=({"strategy": "local_sgd",
                                                    "local_sgd": {"period": 1}},))
    every_4 = shoal.spawn(_fit, nprocs=2, args=({"strategy": "local_sgd",
                                                 "local_sgd": {"period": 4}},))
    for rank in range(2):
        # Averaging w - lr*g_r equals stepping with the averaged g, up to rounding.
        assert max_rel_diff(every_step[rank], ddp[rank]) <= 1e-6
        # 12 steps end on a meeting: the replicas agree, and differ from DDP's.
        for key, value in every_4[rank].items():
            assert torch.equal(value, every_4[0][key])
        assert max_rel_diff(every_4[rank], ddp[rank]) > 1e-4


def test_diloco_is_deterministic_and_is_local_sgd_without_outer_momentum():
    settings = {"strategy": "diloco", "diloco": {"period": 3}}
    first = shoal.spawn(_fit, nprocs=2, args=(settings, 0.9))
    second = shoal.spawn(_fit, nprocs=2, args=(settings, 0.9))
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # Outer SGD with lr 1 and no momentum moves the shared weights to the replicas' mean.
    plain_outer = {"strategy": "diloco",
                   "diloco": {"period": 3, "outer_lr": 1.0, "outer_momentum": 0.0}}
    local = {"strategy": "local_sgd", "local_sgd": {"period": 3}}
    outer = shoal.spawn(_fit, nprocs=2, args=(plain_outer, 0.9))
    averaged = shoal.spawn(_fit, nprocs=2, args=(local, 0.9))
    for rank in range(2):
        assert max_rel_diff(outer[rank], averaged[rank]) <= 1e-6
        assert max_rel_diff(first[rank], averaged[rank]) > 1e-4  # momentum matters


def test_training_ends_with_one_model():
    # 12 steps with period 5: the last two steps were taken apart; fit meets once more.
    for settings in ({"strategy": "local_sgd", "local_sgd": {"period": 5}},
                     {"strategy": "diloco", "diloco": {"period": 5}}):
        replicas = shoal.spawn(_fit, nprocs=2, args=(settings, 0.9))
        for key, value in replicas[1].items():
            assert torch.equal(value, replicas[0][key]), (settings["strategy"], key)
