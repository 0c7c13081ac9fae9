"""The from-scratch samplers: equal to torch's DistributedSampler, and the
class-imbalance variants do what they claim."""

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler as TorchSampler

from ddp_course.sampler import (
    DistributedSampler,
    StratifiedDistributedSampler,
    WeightedDistributedSampler,
    class_balanced_weights,
    num_samples_per_rank,
    rank_indices,
)

SIZES = [0, 1, 2, 3, 5, 7, 10, 16, 17, 100, 1000]
WORLD_SIZES = [1, 2, 3, 4, 5, 8]


@pytest.mark.parametrize("shuffle, drop_last", list(itertools.product([False, True], repeat=2)))
def test_equals_torch_distributed_sampler(shuffle, drop_last):
    checked = 0
    for n, world, seed, epoch in itertools.product(SIZES, WORLD_SIZES, [0, 7], [0, 1, 5]):
        for rank in range(world):
            theirs = TorchSampler(
                range(n),
                num_replicas=world,
                rank=rank,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
            )
            theirs.set_epoch(epoch)
            ours = DistributedSampler(n, world, rank, shuffle, seed, drop_last)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs), (n, world, rank, seed, epoch)
            assert len(ours) == len(theirs)
            checked += 1
    assert checked == len(SIZES) * sum(WORLD_SIZES) * 2 * 3


def test_accepts_a_dataset_or_its_length():
    assert list(DistributedSampler(range(7), 2, 1, shuffle=False)) == [1, 3, 5, 0]
    assert list(DistributedSampler(7, 2, 1, shuffle=False)) == [1, 3, 5, 0]


@pytest.mark.parametrize("n, world", [(10, 3), (1000, 3), (7, 4), (2, 5)])
def test_padding_and_drop_last(n, world):
    padded = [rank_indices(n, world, r, shuffle=True, seed=3) for r in range(world)]
    flat = [i for part in padded for i in part]
    assert len(flat) == world * -(-n // world)  # ceil
    assert set(flat) == set(range(n))  # every sample at least once
    assert len(flat) - n == sum(c - 1 for c in Counter(flat).values())  # the rest repeats
    cut = [rank_indices(n, world, r, shuffle=True, seed=3, drop_last=True) for r in range(world)]
    flat = [i for part in cut for i in part]
    assert len(flat) == len(set(flat)) == n // world * world  # no repeats, tail dropped


def test_set_epoch_changes_the_order_and_forgetting_it_does_not():
    sampler = DistributedSampler(50, 2, 0, seed=1)
    forgot = [list(sampler) for _ in range(3)]
    assert forgot[0] == forgot[1] == forgot[2]
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] == forgot[0]
    assert orders[0] != orders[1] != orders[2]


def test_num_samples_per_rank():
    assert num_samples_per_rank(1000, 3) == 334
    assert num_samples_per_rank(1000, 3, drop_last=True) == 333
    assert num_samples_per_rank(2, 3, drop_last=True) == 0
    assert num_samples_per_rank(9, 3, drop_last=True) == 3


@pytest.mark.parametrize("make", [DistributedSampler, StratifiedDistributedSampler])
@pytest.mark.parametrize("world, rank", [(2, 2), (2, -1), (0, 0)])
def test_bad_rank_raises(make, world, rank):
    with pytest.raises(ValueError, match="rank|num_replicas"):
        make([0, 1, 2], world, rank)


def test_bad_weights_raise():
    with pytest.raises(ValueError, match="not all zero"):
        WeightedDistributedSampler([0.0, 0.0], 2, 0)
    with pytest.raises(ValueError, match="non-negative"):
        WeightedDistributedSampler([1.0, -1.0], 2, 0)
    with pytest.raises(ValueError, match="empty"):
        StratifiedDistributedSampler([], 2, 0)


IMBALANCED = [0] * 90 + [1] * 8 + [2] * 2


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 1])
def test_stratified_gives_every_rank_the_same_mix(world, epoch):
    counts, seen = [], []
    for rank in range(world):
        sampler = StratifiedDistributedSampler(IMBALANCED, world, rank, seed=5)
        sampler.set_epoch(epoch)
        mine = list(sampler)
        assert len(mine) == len(sampler) == -(-len(IMBALANCED) // world)
        seen += mine
        counts.append(Counter(IMBALANCED[i] for i in mine))
    assert set(seen) == set(range(len(IMBALANCED)))
    for c in (1, 2):  # the padding repeats class 0 only
        per_rank = [cnt[c] for cnt in counts]
        assert max(per_rank) - min(per_rank) <= 1, per_rank
        assert sum(per_rank) == IMBALANCED.count(c)


def test_stratified_shuffles_with_the_epoch():
    sampler = StratifiedDistributedSampler(IMBALANCED, 2, 0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    fixed = StratifiedDistributedSampler(IMBALANCED, 2, 0, shuffle=False)
    before = list(fixed)
    fixed.set_epoch(1)
    assert list(fixed) == before


def test_class_balanced_weights():
    w = class_balanced_weights(torch.tensor(IMBALANCED))
    assert w.dtype == torch.float64
    per_class = [float(w[torch.tensor(IMBALANCED) == c].sum()) for c in range(3)]
    assert per_class == pytest.approx([1.0, 1.0, 1.0])


def test_weighted_sampler_balances_classes_across_ranks():
    weights = class_balanced_weights(IMBALANCED)
    world, draws = 3, 3000
    parts = [
        list(WeightedDistributedSampler(weights, world, r, num_samples=draws, seed=2))
        for r in range(world)
    ]
    assert all(len(p) == draws // world for p in parts)
    # The ranks' draws are disjoint slices of one global draw.
    gen = torch.Generator().manual_seed(2)
    whole = torch.multinomial(weights, draws, replacement=True, generator=gen).tolist()
    assert [i for rnd in zip(*parts, strict=True) for i in rnd] == whole
    freq = Counter(IMBALANCED[i] for p in parts for i in p)
    # Each class about a third (binomial sd about 26 in 3000 draws).
    assert all(abs(freq[c] - draws / 3) < 150 for c in range(3)), freq
