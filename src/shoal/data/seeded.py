"""Random numbers a dataset draws as it reads a sample (a random transform), made the
sample's own: from (run seed, epoch, sample index), whatever was read before it and in
whichever process.

Without this, a sample's random crop depends on the generator's history: on the samples
read before it in this process, on a DataLoader worker's base seed and on which worker
reads it. A resume in mid-epoch, a live group's replacement or a step done again then read
the same samples with other random numbers, and a run that should continue exactly does
not. ``shard_dataloader`` wraps a training dataset whose first sample moves Python's,
numpy's or torch's generator (``draws_random_numbers``) in ``SeededSamples``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from shoal.checkpoint import rng
from shoal.runtime.seeds import seed_cpu


def draws_random_numbers(dataset: Any) -> bool:
    """Whether reading ``dataset[0]`` draws from Python's, numpy's or torch's generator
    (their states are put back after)."""
    before = rng.capture()
    try:
        dataset[0]
    except Exception:  # noqa: BLE001 - an empty or odd dataset: read as it is
        return False
    finally:
        after = rng.capture()
        rng.restore(before)
    return any(not torch.equal(before[key], after[key]) for key in before)


class SeededSamples(Dataset):
    """``dataset`` whose sample ``i`` of epoch ``epoch`` is read with the generators seeded
    from (``seed``, epoch, i). ``epoch`` is set before each epoch's iterator is made (a
    DataLoader's workers take a copy of the dataset then).

    The generators go on from the last sample's seed: a process that reads its batches
    itself (no workers) draws its dropout from there, which a resume then draws alike. (To
    put them back as they were would cost 70 us a sample here, numpy's state most of it;
    seeding costs about 6.)"""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        # (A sample is read on the CPU, in this process or a worker: its generators only.)
        seed_cpu(hash((self.seed, self.epoch, int(index))) % 2**63)
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        # The dataset's own attributes (classes, ...). Not the fields above, which a copy
        # being unpickled does not have yet, nor special names: a DataLoader that found
        # the dataset's __getitems__ would read a batch without seeding each sample.
        if name in ("dataset", "seed", "epoch") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
