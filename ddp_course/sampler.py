"""Distributed samplers from scratch: which rank reads which sample.

:class:`DistributedSampler` gives exactly the indices of
``torch.utils.data.DistributedSampler``
(https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler),
computed step by step in :func:`rank_indices`:

1. order: ``0..n-1``, or a permutation drawn from a generator seeded with
   ``seed + epoch``, the same on every rank (so forgetting ``set_epoch``
   repeats the first epoch's order forever; pytorch#31771);
2. make the length a multiple of the world size N: pad by repeating the
   first indices (evaluation then counts them twice; pytorch#25162) or,
   with ``drop_last``, cut the tail;
3. rank r takes every N-th index starting at r.

Two variants for class imbalance: :class:`StratifiedDistributedSampler`
gives every rank the same class mix (each class split evenly across
ranks), :class:`WeightedDistributedSampler` draws samples with replacement
in proportion to weights (e.g. :func:`class_balanced_weights`), the same
draw on every rank, each rank taking its share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized

import torch
from torch.utils.data import Sampler

__all__ = [
    "DistributedSampler",
    "StratifiedDistributedSampler",
    "WeightedDistributedSampler",
    "class_balanced_weights",
    "num_samples_per_rank",
    "rank_indices",
]


def _check_ranks(num_replicas: int, rank: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}] for {num_replicas} ranks")


def _length(dataset: Sized | int) -> int:
    n = dataset if isinstance(dataset, int) else len(dataset)
    if n < 0:
        raise ValueError(f"a data set cannot have {n} samples")
    return n


def num_samples_per_rank(num_samples: int, num_replicas: int, drop_last: bool = False) -> int:
    """How many indices each of ``num_replicas`` ranks gets from ``num_samples``.

    ``ceil(n / N)`` with padding; with ``drop_last`` the largest multiple of
    N below n, divided by N (torch writes it ``ceil((n - N) / N)`` when N
    does not divide n). Every rank gets the same number, so every rank runs
    the same number of steps.

    Raises:
        ValueError: if ``num_samples < 0`` or ``num_replicas < 1``.
    """
    _check_ranks(num_replicas, 0)
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, not {num_samples}")
    if drop_last:
        return num_samples // num_replicas
    return math.ceil(num_samples / num_replicas)


def _pad_or_cut(order: list[int], total: int) -> list[int]:
    if len(order) >= total:
        return order[:total]
    # Wrap around, as many times as needed: with more ranks than samples
    # the data set repeats more than once.
    reps = math.ceil(total / len(order))
    return (order * reps)[:total]


def rank_indices(
    num_samples: int,
    num_replicas: int,
    rank: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> list[int]:
    """The indices rank ``rank`` of ``num_replicas`` reads in epoch ``epoch``.

    Equal to ``list(torch.utils.data.DistributedSampler(...))`` after
    ``set_epoch(epoch)``. The shuffle uses ``torch.randperm`` with a
    ``torch.Generator`` seeded ``seed + epoch``: the same generator and
    seed give the same permutation, which is what makes the ranks agree
    without communicating.

    Returns:
        ``num_samples_per_rank(num_samples, num_replicas, drop_last)`` ints
        in ``[0, num_samples)``.

    Raises:
        ValueError: if ``rank`` is not in ``[0, num_replicas)``,
            ``num_replicas < 1`` or ``num_samples < 0``.
    """
    _check_ranks(num_replicas, rank)
    per_rank = num_samples_per_rank(num_samples, num_replicas, drop_last)
    total = per_rank * num_replicas
    if shuffle:
        gen = torch.Generator()
        gen.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=gen).tolist()
    else:
        order = list(range(num_samples))
    if num_samples == 0:
        return []
    order = _pad_or_cut(order, total)
    return order[rank:total:num_replicas]


class DistributedSampler(Sampler[int]):
    """``torch.utils.data.DistributedSampler``, from scratch (see :func:`rank_indices`).

    Args:
        dataset: the data set, or its length.
        num_replicas: the world size N; explicit, so the sampler also works
            without a process group (pass ``ctx.world_size``).
        rank: this rank, ``0 <= rank < N`` (pass ``ctx.rank``).
        shuffle: draw a new permutation each epoch.
        seed: the same on every rank, or ranks would read overlapping samples.
        drop_last: cut the tail instead of padding with repeated indices.

    Raises:
        ValueError: on a rank outside ``[0, N)`` or ``N < 1``.

    Call :meth:`set_epoch` before each epoch, or every epoch repeats the
    first one's order.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        _check_ranks(num_replicas, rank)
        self.num_total = _length(dataset)
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = num_samples_per_rank(self.num_total, num_replicas, drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use ``seed + epoch`` for the next iteration's permutation."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(
            rank_indices(
                self.num_total,
                self.num_replicas,
                self.rank,
                self.shuffle,
                self.seed,
                self.epoch,
                self.drop_last,
            )
        )

    def __len__(self) -> int:
        return self.num_samples


def _labels_list(labels: Sequence[int] | torch.Tensor) -> list[int]:
    values = labels.tolist() if isinstance(labels, torch.Tensor) else [int(v) for v in labels]
    if not values:
        raise ValueError("labels is empty")
    return values


class StratifiedDistributedSampler(DistributedSampler):
    """Every rank gets the same mix of classes.

    Each epoch the indices of each class are shuffled (generator seeded
    ``seed + epoch``), the classes are laid end to end, the list is padded
    or cut to a multiple of N as in :class:`DistributedSampler`, and rank r
    takes every N-th index from r. A class is a contiguous run, so every
    rank gets ``floor`` or ``ceil`` of ``count / N`` of each class: with a
    rare class, no rank goes without it. Each rank's indices are then
    shuffled (same generator), so batches mix classes.

    Args:
        labels: one class label per sample, ``int`` (list or int64 tensor ``[n]``).
        num_replicas, rank, shuffle, seed, drop_last: as in
            :class:`DistributedSampler`.

    Raises:
        ValueError: on empty ``labels`` or a bad rank.
    """

    def __init__(
        self,
        labels: Sequence[int] | torch.Tensor,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.labels = _labels_list(labels)
        super().__init__(len(self.labels), num_replicas, rank, shuffle, seed, drop_last)

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        by_class: dict[int, list[int]] = {}
        for i, c in enumerate(self.labels):
            by_class.setdefault(c, []).append(i)
        order: list[int] = []
        for c in sorted(by_class):
            members = by_class[c]
            if self.shuffle:
                members = [members[j] for j in torch.randperm(len(members), generator=gen)]
            order += members
        total = self.num_samples * self.num_replicas
        mine = _pad_or_cut(order, total)[self.rank : total : self.num_replicas]
        if self.shuffle:
            mine = [mine[j] for j in torch.randperm(len(mine), generator=gen)]
        return iter(mine)


def class_balanced_weights(labels: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Per-sample weights ``1 / count(class)``: every class gets the same total weight.

    Returns:
        float64 tensor ``[n]``; draws in proportion to it pick each class
        with probability ``1 / num_classes``.

    Raises:
        ValueError: on empty ``labels``.
    """
    values = torch.tensor(_labels_list(labels))
    counts = torch.bincount(values - values.min())
    return 1.0 / counts[values - values.min()].double()


class WeightedDistributedSampler(Sampler[int]):
    """Sample with replacement in proportion to ``weights``, split across ranks.

    Each epoch every rank draws the same ``total`` indices with
    ``torch.multinomial`` (generator seeded ``seed + epoch``) and keeps
    every N-th from its rank, so the ranks' draws are disjoint parts of
    one global draw: ``torch.utils.data.WeightedRandomSampler`` made
    distributed. With :func:`class_balanced_weights`, rare classes are
    oversampled until every class is drawn equally often.

    Args:
        weights: non-negative float ``[n]``, not all zero.
        num_replicas, rank, seed: as in :class:`DistributedSampler`.
        num_samples: draws per epoch over all ranks (default ``n``),
            rounded up to a multiple of N.

    Raises:
        ValueError: on a bad rank, negative or all-zero weights,
            ``num_samples < 1``.
    """

    def __init__(
        self,
        weights: Sequence[float] | torch.Tensor,
        num_replicas: int,
        rank: int,
        num_samples: int | None = None,
        seed: int = 0,
    ):
        _check_ranks(num_replicas, rank)
        self.weights = torch.as_tensor(weights, dtype=torch.float64)
        if self.weights.dim() != 1 or len(self.weights) == 0:
            raise ValueError(
                f"weights must be a non-empty 1-D sequence, got {tuple(self.weights.shape)}"
            )
        if (self.weights < 0).any() or self.weights.sum() <= 0:
            raise ValueError("weights must be non-negative and not all zero")
        num_samples = len(self.weights) if num_samples is None else num_samples
        if num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, not {num_samples}")
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.epoch = 0
        self.num_samples = math.ceil(num_samples / num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Use ``seed + epoch`` for the next iteration's draw."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        total = self.num_samples * self.num_replicas
        draw = torch.multinomial(self.weights, total, replacement=True, generator=gen)
        return iter(draw[self.rank : total : self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples
