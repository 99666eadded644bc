"""Properties of the elastic batch sampler, over dataset size, W, batch size, drop_last and
resume point: each sample at most once per epoch, nothing but a small stated tail left out,
the same global order for every W, and resume continuing exactly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DistributedSampler

from shoal.data.sampler import ElasticSampler


def global_sequence(length, world, batch, *, seed=3, epoch=0, drop_last=False, consumed=0):
    """The samples every step consumes, in order: rank shares merged per global batch."""
    samplers = [ElasticSampler(length, world, r, batch, seed=seed, drop_last=drop_last)
                for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch, consumed)
    for s in samplers:
        assert len(s) == len(list(s))
    # Cut each rank's stream into batches as the DataLoader does.
    per_rank = [list(BatchSampler(s, batch, drop_last=False)) for s in samplers]
    assert len({len(batches) for batches in per_rank}) == 1, "ranks disagree on batch count"
    steps = []
    for step in zip(*per_rank, strict=True):
        assert all(step), "a rank got an empty batch"
        steps.append(sorted(i for share in step for i in share))
    return steps


sizes = st.integers(min_value=0, max_value=120)
worlds = st.integers(min_value=1, max_value=5)
batches = st.integers(min_value=1, max_value=9)


@settings(max_examples=300, deadline=None)
@given(length=sizes, world=worlds, batch=batches, drop_last=st.booleans(),
       epoch=st.integers(0, 3))
def test_each_sample_at_most_once_and_only_a_small_tail_left_out(length, world, batch,
                                                                   drop_last, epoch):
    steps = global_sequence(length, world, batch, epoch=epoch, drop_last=drop_last)
    seen = [i for step in steps for i in step]
    assert len(seen) == len(set(seen))
    assert set(seen) <= set(range(length))
    left_out = length - len(seen)
    if drop_last:
        assert left_out == length % (world * batch)
    else:
        tail = length % (world * batch)
        assert left_out == (tail if tail < world else 0)
    assert all(len(step) == world * batch for step in steps[:-1])


@settings(max_examples=200, deadline=None)
@given(length=sizes, world=worlds, other=worlds, batch=batches, epoch=st.integers(0, 3))
def test_global_order_is_the_same_for_every_world_size(length, world, other, batch, epoch):
    # With the same global batch, W and W' consume the same samples step by step.
    a = global_sequence(length, world, batch * other, epoch=epoch, drop_last=True)
    b = global_sequence(length, other, batch * world, epoch=epoch, drop_last=True)
    assert a == b


@settings(max_examples=300, deadline=None)
@given(length=sizes, world=worlds, batch=batches, drop_last=st.booleans(), data=st.data())
def test_resume_continues_at_the_next_global_sample(length, world, batch, drop_last, data):
    # From any point of the epoch, at any W, the steps are the next windows of the global
    # order: a run saved at W after c samples and resumed at W' continues exactly.
    consumed = data.draw(st.integers(0, length))
    steps = global_sequence(length, world, batch, drop_last=drop_last, consumed=consumed)
    order = ElasticSampler(length, 1, 0, 1, seed=3).global_order().tolist()
    g = world * batch
    expected = [sorted(order[i:i + g]) for i in range(consumed, length, g)]
    assert steps == expected[:len(steps)]
    remaining = length - consumed
    tail = remaining % g
    assert len(expected) - len(steps) == (1 if (drop_last and tail) or 0 < tail < world else 0)


@given(length=st.integers(1, 100), world=worlds, batch=batches, epoch=st.integers(0, 3))
def test_matches_distributed_sampler_when_sizes_divide(length, world, batch, epoch):
    length = length * world * batch
    for rank in range(world):
        ours = ElasticSampler(length, world, rank, batch, seed=5)
        ours.set_epoch(epoch)
        theirs = DistributedSampler(range(length), num_replicas=world, rank=rank, seed=5)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)


def test_order_depends_on_seed_and_epoch():
    def first(seed, epoch):
        s = ElasticSampler(50, 1, 0, 50, seed=seed)
        s.set_epoch(epoch)
        return list(s)
    assert first(0, 0) == first(0, 0)
    assert first(0, 0) != first(0, 1) and first(0, 0) != first(1, 0)
    assert sorted(first(0, 0)) == list(range(50))
    assert torch.equal(torch.tensor(first(2, 3)), torch.randperm(
        50, generator=torch.Generator().manual_seed(5)))
