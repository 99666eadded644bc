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
    model3 = make_model()
    trainer3 = shoal.Trainer(model3, make_optimizer(model3), accumulate_grad_batches=2,
                             progress=False)
    accumulated = trainer3.fit(DataLoader(RankStream(rank), batch_size=8),
                               epochs=1)["global_step"]
    weights = torch.cat([p.detach().flatten() for p in model3.parameters()])
    return streamed, sampled, accumulated, weights


def test_uneven_ranks_finish_together():
    results = shoal.spawn(_fit_uneven, nprocs=2)
    # Streams: as many steps as the shortest rank has batches (3). Sized: the minimum length
    # (5 a epoch). Accumulating 2 over the 3-batch stream: one full window, one partial.
    assert [r[:3] for r in results] == [(3, 10, 2), (3, 10, 2)]
    # The replicas never diverged, although the stream's length was not known in advance.
    assert torch.equal(results[0][3], results[1][3])
    # And they equal one process stepping on batches 0-1, then on batch 2 alone (the short
    # last window counts as its own length, not as K).
    batches = list(DataLoader(RankStream(1), batch_size=8))
    model = make_model()
    opt = make_optimizer(model)
    for window in (batches[:2], batches[2:3]):
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (results[0][3] - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_empty_training_data_is_a_clear_error(single_process):
    import pytest

    from shoal.errors import UsageError

    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), progress=False)
    empty = TensorDataset(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long))
    with pytest.raises(UsageError, match="gave no batch"):
        trainer.fit(empty, max_steps=5)
