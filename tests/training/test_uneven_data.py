"""Ranks with different amounts of data never hang: they agree on how many batches to run."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import shoal
from tests.training.reference import make_model, make_optimizer


class RankStream(IterableDataset):
    """Rank r yields 8 * (5 - 2r) samples: 5 batches on rank 0, 3 on rank 1."""

    def __init__(self, rank: int):
        self.count = 8 * (5 - 2 * rank)

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.count):
            yield torch.randn(10, generator=g), torch.randint(0, 3, (), generator=g)


class UnevenBatches:
    """A batch sampler with one more batch on rank 0 than on rank 1."""

    def __init__(self, rank: int):
        self.batches = [list(range(i, i + 4)) for i in range(0, 4 * (6 - rank), 4)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def _fit_uneven():
    shoal.init("gloo")
    rank = shoal.rank()
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=8, progress=False)
    streamed = trainer.fit(DataLoader(RankStream(rank), batch_size=8), epochs=1)["global_step"]
    data = TensorDataset(torch.randn(64, 10), torch.randint(0, 3, (64,)))
    model2 = make_model()
    trainer2 = shoal.Trainer(model2, make_optimizer(model2), progress=False)
    sampled = trainer2.fit(DataLoader(data, batch_sampler=UnevenBatches(rank)),
                           epochs=2)["global_step"]
    return streamed, sampled


def test_uneven_ranks_finish_together():
    results = shoal.spawn(_fit_uneven, nprocs=2)
    # Streams: as many steps as the shortest rank has batches. Sized: the minimum length.
    assert results == [(3, 10), (3, 10)]
