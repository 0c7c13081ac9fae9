"""ddp_course.partition: the one rule that cuts a tensor into per-rank shards, in the
ring's, ZeRO's and tensor parallelism's styles."""

import pytest
import torch

from ddp_course.partition import check_rank, partition


@pytest.mark.parametrize("numel", [0, 1, 5, 12, 13, 1001])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_split_cuts_like_tensor_split(numel, n):
    bounds = partition(numel, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    split = torch.arange(numel).tensor_split(n)
    assert [b - a for a, b in bounds] == [len(s) for s in split]


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 6, 7, 100, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_padded_shards_cover_the_tensor_once_in_rank_order(numel, world_size):
    ranges = partition(numel, world_size, "padded")
    covered = [i for start, end in ranges for i in range(start, end)]
    assert covered == list(range(numel))  # every element once, rank 0 first
    slots = -(-numel // world_size)
    assert all(end - start <= slots for start, end in ranges)  # fits the padded slot
    # Every shard but the trailing ones is a full slot: the padding sits at the end.
    full = [end - start == slots for start, end in ranges]
    assert full == sorted(full, reverse=True)


def test_padded_examples_by_hand():
    assert partition(5, 3, "padded") == [(0, 2), (2, 4), (4, 5)]
    assert partition(4, 3, "padded") == [(0, 2), (2, 4), (4, 4)]  # an empty shard
    assert partition(1, 3, "padded") == [(0, 1), (1, 1), (1, 1)]
    assert partition(4, 3) == [(0, 2), (2, 3), (3, 4)]  # split: no empty shard


def test_even_shards_and_the_error_that_names_the_dimension():
    assert partition(24, 4, "even")[0] == (0, 6) and partition(24, 4, "even")[3] == (18, 24)
    with pytest.raises(ValueError, match=r"hidden=10 is not divisible by the world size 4.*12"):
        partition(10, 4, "even", "hidden")


@pytest.mark.parametrize(
    ("args", "match"),
    [((10, 0), "world_size"), ((-1, 2), "numel"), ((4, 2, "ring"), "style")],
)
def test_partition_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        partition(*args)


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0)])
def test_check_rank_rejects_what_would_index_the_wrong_shard(rank, world_size):
    with pytest.raises(ValueError):
        check_rank(rank, world_size)
