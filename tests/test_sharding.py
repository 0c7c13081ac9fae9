"""ZeRO from scratch: memory per rank against the paper, shards, stages 1-3 against DDP."""

import pytest

from ddp_course.sharding import FP32_ADAM, MIXED_ADAM, shard_range, state_bytes_per_rank

GB = 1e9


@pytest.mark.parametrize(
    ("stage", "paper_gb"),
    [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)],  # ZeRO paper, Figure 1: Psi = 7.5B, N = 64
)
def test_memory_matches_the_papers_figure_1(stage, paper_gb):
    got = state_bytes_per_rank(stage, 7_500_000_000, 64, MIXED_ADAM).total / GB
    assert got == pytest.approx(paper_gb, abs=0.05)


def test_memory_matches_the_papers_table_1():
    # ZeRO paper, Table 1, 7.5B parameters: N = 1024 gives 7.5B * 16 / 1024 bytes = 0.12 GB
    # at stage 3; N = 1 gives 120 GB at every stage.
    assert state_bytes_per_rank(3, 7_500_000_000, 1024).total / GB == pytest.approx(0.12, abs=0.01)
    for stage in range(4):
        assert state_bytes_per_rank(stage, 7_500_000_000, 1).total / GB == pytest.approx(120)


def test_sixteen_bytes_per_parameter_and_fp32_adam():
    assert state_bytes_per_rank(0, 1, 8).total == 16  # 2 + 2 + 12
    fp32 = state_bytes_per_rank(2, 1000, 4, FP32_ADAM)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4000, 1000, 2000)


@pytest.mark.parametrize("bad", [dict(stage=4), dict(num_params=-1), dict(world_size=0)])
def test_memory_bad_input(bad):
    kwargs = dict(stage=1, num_params=10, world_size=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        state_bytes_per_rank(**kwargs)


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 6, 7, 100, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_shards_cover_the_tensor_once_in_rank_order(numel, world_size):
    ranges = [shard_range(numel, r, world_size) for r in range(world_size)]
    covered = [i for start, end in ranges for i in range(start, end)]
    assert covered == list(range(numel))  # every element once, rank 0 first
    sizes = [end - start for start, end in ranges]
    slots = -(-numel // world_size)
    assert all(size <= slots for size in sizes)  # fits the padded collective's slot


def test_shards_examples_by_hand():
    assert [shard_range(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [shard_range(4, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 4)]  # empty shard
    assert [shard_range(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize("args", [(-1, 0, 2), (4, 2, 2), (4, -1, 2), (4, 0, 0)])
def test_shard_range_bad_input(args):
    with pytest.raises(ValueError):
        shard_range(*args)
