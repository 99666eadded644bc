"""Give each rank its share of the data, so that every rank runs the same number of steps."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
)

from shoal.data.sampler import ElasticSampler


class EvalShardSampler(Sampler[int]):
    """Rank r reads samples r, r+W, r+2W, ... with no padding, so evaluation counts each once."""

    def __init__(self, length: int, world_size: int, rank: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def shard_dataloader(data: Dataset | DataLoader, *, world_size: int, rank: int,
                     batch_size: int, shuffle: bool, seed: int, evaluation: bool = False,
                     num_workers: int = 0) -> DataLoader:
    """A DataLoader that yields only this rank's samples.

    Training uses ElasticSampler (global order from seed and epoch; rank r takes every W-th
    sample of each global batch), so W ranks with batch B see exactly the samples one process
    sees with batch W*B. A DataLoader keeps its batch size, collate function and workers.
    """
    loader = data if isinstance(data, DataLoader) else None
    dataset = loader.dataset if loader is not None else data
    if loader is not None:
        batch_size = loader.batch_size or batch_size
        shuffle = isinstance(loader.sampler, RandomSampler)
        if isinstance(dataset, IterableDataset) or isinstance(
                loader.sampler, (DistributedSampler, ElasticSampler, EvalShardSampler)):
            return loader  # already sharded by the user
        if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
            warnings.warn("custom batch_sampler kept as is: shard its batches yourself",
                          stacklevel=3)
            return loader
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    if evaluation:
        sampler: Sampler[int] = EvalShardSampler(len(dataset), world_size, rank)
    else:
        sampler = ElasticSampler(len(dataset), world_size, rank, batch_size, seed=seed,
                                 shuffle=shuffle,
                                 drop_last=loader is not None and loader.drop_last)
    kwargs = {"batch_size": batch_size, "num_workers": num_workers}
    if loader is not None:
        # drop_last is the sampler's business now: it knows where global batches end.
        kwargs.update(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory,
                      persistent_workers=loader.persistent_workers)
    return DataLoader(dataset, sampler=sampler, **kwargs)


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """Reshuffle for ``epoch``: every rank derives the same global order from (seed, epoch)."""
    sampler = loader.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def agreed_length(loader: DataLoader, device: torch.device) -> int | None:
    """The number of batches every rank will run this epoch, or None for an unsized loader.

    ElasticSampler and DistributedSampler give every rank the same length by construction.
    For any other loader, one all-reduce per epoch takes the smallest length over ranks, so
    a rank with an extra batch cannot leave the others waiting in a collective forever.
    """
    try:
        length = len(loader)
    except TypeError:
        return None
    if (not dist.is_initialized() or dist.get_world_size() == 1
            or isinstance(loader.sampler, (DistributedSampler, ElasticSampler))):
        return length
    count = torch.tensor([length], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


def agreed_batches(loader: DataLoader, length: int | None, device: torch.device) -> Iterator:
    """Iterate ``loader`` for ``length`` batches; unsized, stop when any rank runs out."""
    if length is not None:
        yield from itertools.islice(loader, length)
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    iterator = iter(loader)
    while True:
        batch = next(iterator, None)
        if world > 1:
            # Before every batch, all ranks agree that each still has one.
            flag = torch.tensor([0 if batch is None else 1], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item() == 0:
                return
        elif batch is None:
            return
        yield batch
