"""A sample's random numbers are its own: from (seed, epoch, index), in any process, after
any history."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from shoal.checkpoint import rng
from shoal.data.seeded import SeededSamples, draws_random_numbers
from shoal.data.sharding import set_epoch, shard_dataloader


class Augmented(torch.utils.data.Dataset):
    """Noise from all three generators, drawn as a sample is read (a random transform)."""

    def __init__(self, n: int = 24):
        self.x = torch.arange(n, dtype=torch.float32).unsqueeze(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        noise = torch.rand(1) + random.random() + float(np.random.rand())
        return self.x[index] + noise


def test_a_dataset_that_draws_is_told_from_one_that_does_not_and_nothing_moves():
    before = rng.capture()
    assert draws_random_numbers(Augmented())
    assert not draws_random_numbers(TensorDataset(torch.arange(4.0)))
    assert not draws_random_numbers([])  # no sample 0: read as it is
    after = rng.capture()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_a_sample_is_its_own_whatever_was_drawn_before():
    data = SeededSamples(Augmented(), seed=7)
    first = data[5]
    torch.rand(3), random.random(), np.random.rand()  # another history
    data[3]
    assert torch.equal(data[5], first)
    data.epoch = 1
    assert not torch.equal(data[5], first)
    assert SeededSamples(Augmented(), seed=8)[5].item() != first.item()


def _epoch(loader, epoch: int, position: int = 0) -> list[torch.Tensor]:
    set_epoch(loader, epoch, position)
    return [batch for batch in loader]


@pytest.mark.timeout(120)
def test_workers_and_a_mid_epoch_start_read_the_samples_one_process_reads():
    # The same rank's batches from the main process and from 2 workers, and a start after
    # the epoch's first 8 samples (a resume): the same numbers.
    def loader(workers: int):
        return shard_dataloader(Augmented(), world_size=2, rank=1, batch_size=4, shuffle=True,
                                seed=3, num_workers=workers)
    alone = _epoch(loader(0), 1)
    assert isinstance(loader(0).dataset, SeededSamples)
    assert all(torch.equal(a, b) for a, b in zip(alone, _epoch(loader(2), 1), strict=True))
    resumed = _epoch(loader(0), 1, position=8)
    assert all(torch.equal(a, b) for a, b in zip(alone[1:], resumed, strict=True))
    assert not torch.equal(alone[0], _epoch(loader(0), 2)[0])  # another epoch, other noise


def test_a_dataset_that_does_not_draw_is_read_as_it_is():
    loader = shard_dataloader(TensorDataset(torch.arange(8.0)), world_size=1, rank=0,
                              batch_size=4, shuffle=False, seed=0)
    assert isinstance(loader.dataset, TensorDataset)


def test_persistent_workers_are_told_and_read_as_they_are():
    # They keep the first epoch's copy of the dataset: its samples cannot be seeded per
    # epoch, and the user is told why a resume may read other random numbers.
    given = torch.utils.data.DataLoader(Augmented(), batch_size=4, shuffle=True,
                                        num_workers=1, persistent_workers=True)
    with pytest.warns(UserWarning, match="persistent workers keep the first epoch's copy"):
        loader = shard_dataloader(given, world_size=2, rank=0, batch_size=4, shuffle=True,
                                  seed=0)
    assert isinstance(loader.dataset, Augmented)
