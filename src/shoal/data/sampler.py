"""A sampler whose global sample order depends only on (seed, epoch).

Global micro-batch m is positions ``[m*W*B, (m+1)*W*B)`` of the epoch's permutation; rank r
of W reads every W-th of them, starting at r. When the sizes divide, this is exactly what
torch's DistributedSampler gives each rank, batch after batch. Unlike it, this sampler can
start at any position in the epoch (global samples already consumed), with any world size:
a run resumed at W' continues at the very next global sample.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ElasticSampler(Sampler[int]):
    """Yields this rank's indices, ``batch_size`` per global micro-batch of W*batch_size.

    Used with ``DataLoader(batch_size=batch_size)``, which cuts the stream back into the
    rank's batches; every rank gets the same number of batches. ``drop_last=False`` keeps
    the short final global batch, split over the ranks; only when it has fewer samples than
    ranks are those (at most W-1) left out, so that no rank is left without a batch.
    ``drop_last=True`` drops the incomplete final global batch.
    """

    def __init__(self, length: int, world_size: int, rank: int, batch_size: int, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.length = length
        self.world_size = world_size
        self.rank = rank
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0  # the epoch's position: global samples already consumed

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    def set_epoch(self, epoch: int, position: int = 0) -> None:
        """Start ``epoch`` at ``position``: after that many of its samples (all ranks
        together)."""
        if not 0 <= position <= self.length:
            raise ValueError(f"position {position} lies outside the epoch of {self.length} "
                             "samples")
        self.epoch = epoch
        self.start = position

    def global_order(self) -> torch.Tensor:
        """The epoch's permutation of sample indices, identical on every rank and every W."""
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator)

    def end(self) -> int:
        """Where this epoch's batches stop (exclusive), as a position in the global order."""
        remaining = self.length - self.start
        if self.drop_last:
            return self.start + remaining - remaining % self.global_batch
        tail = remaining % self.global_batch
        return self.length - tail if 0 < tail < self.world_size else self.length

    def __len__(self) -> int:
        """Samples this rank reads from the resume point to the end of the epoch."""
        span = self.end() - self.start
        full, tail = divmod(span, self.global_batch)
        mine = max(0, -(-(tail - self.rank) // self.world_size))  # its share of the tail
        return full * self.batch_size + mine

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        end = self.end()
        for first in range(self.start, end, self.global_batch):
            block = order[first:min(first + self.global_batch, end)]
            yield from block[self.rank::self.world_size].tolist()
