"""Give each rank its share of the data, so that every rank runs the same number of steps."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sized
from typing import Any, cast

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
    SequentialSampler,
)

from shoal.data.sampler import ElasticSampler
from shoal.data.seeded import SeededSamples, draws_random_numbers
from shoal.errors import UsageError


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
                     num_workers: int = 0, drop_last: bool = False,
                     pin_memory: bool = False) -> DataLoader:
    """A DataLoader that yields only this rank's samples.

    Training uses ElasticSampler (global order from seed and epoch; rank r takes every W-th
    sample of each global batch), so W ranks with batch B see exactly the samples one process
    sees with batch W*B. A DataLoader keeps its batch size, collate function and workers.
    ``drop_last`` (training) drops each epoch's incomplete final global batch.
    ``pin_memory`` (a GPU job) lets batches go to the device while the GPU still computes;
    a DataLoader passed in keeps its own setting.
    """
    loader = data if isinstance(data, DataLoader) else None
    dataset = loader.dataset if loader is not None else cast(Dataset, data)
    if isinstance(dataset, IterableDataset):
        if world_size > 1 and rank == 0:
            warnings.warn("an IterableDataset is not split across ranks: every rank reads the "
                          "whole stream unless the dataset shards itself by shoal.rank()",
                          stacklevel=3)
        if loader is not None:
            return loader
        return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                          pin_memory=pin_memory)
    if loader is not None:
        batch_size = loader.batch_size or batch_size
        shuffle = isinstance(loader.sampler, RandomSampler)
        if isinstance(loader.sampler, (DistributedSampler, ElasticSampler, EvalShardSampler)):
            return loader  # already sharded
        if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
            warnings.warn("custom batch_sampler kept as is: shard its batches yourself",
                          stacklevel=3)
            return loader
        if not isinstance(loader.sampler, (SequentialSampler, RandomSampler)):
            if world_size == 1:
                return loader
            raise UsageError(
                f"cannot split a DataLoader with a {type(loader.sampler).__name__} across "
                "ranks: pass a torch.utils.data.Subset of the dataset instead, or a sampler "
                "that takes this rank's share itself (like DistributedSampler)")
    if evaluation:
        sampler: Sampler[int] = EvalShardSampler(len(cast(Sized, dataset)), world_size, rank)
    else:
        sampler = ElasticSampler(len(cast(Sized, dataset)), world_size, rank, batch_size, seed=seed,
                                 shuffle=shuffle,
                                 drop_last=drop_last or (loader is not None and loader.drop_last))
    if not evaluation and draws_random_numbers(dataset):
        if loader is not None and loader.persistent_workers:
            warnings.warn("the dataset draws random numbers as it reads a sample, and "
                          "persistent workers keep the first epoch's copy of it: its samples "
                          "are not seeded (a resume or a live recovery then reads them with "
                          "other random numbers)", stacklevel=3)
        else:
            dataset = SeededSamples(dataset, seed)
    # The loader's own generator: making an iterator draws a seed from it, and drawing from
    # the global RNG instead would shift dropout after a resume (see set_epoch).
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers,
                              "generator": torch.Generator(), "pin_memory": pin_memory}
    if loader is not None:
        # drop_last is the sampler's business now: it knows where global batches end.
        kwargs.update(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory, timeout=loader.timeout,
                      worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context,
                      persistent_workers=loader.persistent_workers)
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(dataset, sampler=sampler, **kwargs)


def set_epoch(loader: DataLoader, epoch: int, position: int = 0) -> bool:
    """Reshuffle for ``epoch``: every rank derives the same global order from (seed, epoch).

    The epoch starts at ``position``: its first ``position`` global samples are skipped
    (resuming). Returns False when the loader cannot start mid-epoch (it then starts the
    epoch from its beginning).
    """
    sampler = loader.sampler
    if isinstance(loader.dataset, SeededSamples):
        loader.dataset.epoch = epoch
    if isinstance(sampler, ElasticSampler):
        sampler.set_epoch(epoch, position)
        if loader.generator is not None:
            # Worker seeds then depend on (seed, epoch, rank) only, never on the history.
            loader.generator.manual_seed(hash((sampler.seed, epoch, sampler.rank)) % 2**62)
        return True
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return position == 0


def samples_between(loader: DataLoader, first: int, last: int) -> int | None:
    """Global samples in micro-batches [first, last) of this epoch's run, if known."""
    before, after = position_after(loader, first), position_after(loader, last)
    # after is None only when before is (a loader without ElasticSampler)
    return None if before is None else cast(int, after) - before


def position_after(loader: DataLoader, micro_batches: int) -> int | None:
    """The epoch's position (global samples consumed) after ``micro_batches`` more batches,
    if known."""
    sampler = loader.sampler
    if not isinstance(sampler, ElasticSampler):
        return None
    return min(sampler.start + micro_batches * sampler.global_batch, sampler.end())


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


def agreed_batches(loader: DataLoader, length: int | None, device: torch.device
                   ) -> Iterator[tuple[Any, bool]]:
    """(batch, is_last) for ``length`` batches; unsized, until any rank runs out.

    An unsized loader is read one batch ahead, and before every batch all ranks agree that
    each still has one, so every rank knows which batch is the epoch's last.
    """
    if length is not None:
        for i, batch in enumerate(itertools.islice(loader, length)):
            yield batch, i == length - 1
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    iterator = iter(loader)

    def agreed_next() -> Any:
        batch = next(iterator, None)
        if world > 1:
            flag = torch.tensor([0 if batch is None else 1], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item() == 0:
                return None
        return batch

    current = agreed_next()
    while current is not None:
        following = agreed_next()
        yield current, following is None
        current = following


def lockstep_batches(loader: DataLoader, device: torch.device) -> Iterator[tuple[Any, bool]]:
    """(batch, counts): as many batches on every rank as on the rank with most.

    A sharded model's forward is collective, so a rank that ran out keeps running forward
    passes, on a batch it already saw (counts False); one that had none at all (a
    validation set smaller than the number of ranks) is sent another rank's.
    """
    world = dist.get_world_size()
    iterator = iter(loader)
    spare = None
    while True:
        batch = next(iterator, None)
        spare = batch if batch is not None else spare
        # 2: a batch; 1: none left but one to repeat; 0: none ever.
        mine = 2 if batch is not None else (1 if spare is not None else 0)
        states = torch.zeros(world, dtype=torch.int64, device=device)
        states[dist.get_rank()] = mine
        dist.all_reduce(states)
        if not (states == 2).any():
            return
        if (states == 0).any():
            first = [batch]
            dist.broadcast_object_list(
                first, src=int((states == 2).nonzero()[0]))
            spare = spare if spare is not None else first[0]
        yield (batch, True) if batch is not None else (spare, False)
