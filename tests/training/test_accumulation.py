"""Gradient accumulation: K micro-batches equal one K-times larger batch, synced once."""

from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import shoal
from tests.helpers import max_rel_diff
from tests.training.reference import (
    SEED,
    make_dataset,
    make_model,
    make_optimizer,
    reference_weights,
)

WORLD, BATCH, K, STEPS = 2, 4, 3, 12  # 30 micro-batches a rank per epoch: crosses one epoch
TOLERANCE = 1e-5


class SyncLog:
    """Counts forward passes and records, for each gradient all-reduce, how many had run."""

    def __init__(self) -> None:
        self.forwards = 0
        self.syncs_at: list[int] = []

    def count_forward(self, module, args) -> None:
        self.forwards += 1

    def hook(self, state, bucket):
        self.syncs_at.append(self.forwards)
        return allreduce_hook(None, bucket)


def _instrument(ddp_model) -> SyncLog:
    log = SyncLog()
    ddp_model.module.register_forward_pre_hook(log.count_forward)
    ddp_model.register_comm_hook(None, log.hook)
    return log


def _accumulate_both_ways():
    shoal.init("gloo")
    dataset = make_dataset()
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=SEED,
                            accumulate_grad_batches=K, progress=False)
    trainer_log = _instrument(trainer.model)
    trainer.fit(dataset, max_steps=STEPS)

    harness = shoal.Harness(seed=SEED)
    model2 = make_model()
    wrapped, opt = harness.setup(model2, make_optimizer(model2))
    harness_log = _instrument(wrapped)
    loader = harness.setup_dataloader(dataset, batch_size=BATCH)
    steps = epoch = 0
    while steps < STEPS:
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % K == 0
            with harness.no_sync(wrapped, enabled=not last):
                harness.backward(F.cross_entropy(wrapped(x), y) / K)
            if last:
                harness.step(opt)
                steps += 1
                if steps == STEPS:
                    break
        epoch += 1
    return {
        "trainer": ({k: v.clone() for k, v in trainer.module.state_dict().items()},
                    trainer_log.syncs_at),
        "harness": ({k: v.clone() for k, v in model2.state_dict().items()},
                    harness_log.syncs_at),
    }


def test_accumulation_equals_larger_batch_and_syncs_once_per_step():
    results = shoal.spawn(_accumulate_both_ways, nprocs=WORLD)
    expected = reference_weights(global_batch=WORLD * BATCH * K, steps=STEPS)
    for rank, result in enumerate(results):
        for api, (weights, syncs_at) in result.items():
            diff = max_rel_diff(weights, expected)
            assert diff <= TOLERANCE, f"{api} rank {rank}: rel diff {diff:.2e}"
            # The tiny model fits one bucket: exactly one all-reduce per optimizer step,
            # each right after the K-th, 2K-th, ... forward pass.
            assert syncs_at == [K * (s + 1) for s in range(STEPS)], (api, syncs_at)

