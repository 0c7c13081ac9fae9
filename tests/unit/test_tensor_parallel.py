"""Tensor-parallel attention and blocks in one process: one rank is the plain module,
bad sizes are refused with a clear error, no process group gives a clear error, not a hang."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_course import runtime
from ddp_course import sequence_parallel as sp
from ddp_course import tensor_parallel as tp
from ddp_course.collectives import group_rank_and_size
from ddp_course.models import Block, CausalSelfAttention, TinyGPT
from ddp_course.parallel_gpt import ParallelGPT
from ddp_course.tensor_parallel import ParallelAttention


@pytest.mark.parametrize("flash", [True, False])
def test_one_rank_is_the_plain_attention_and_block(flash):
    torch.manual_seed(0)
    block = Block(16, 4, flash=flash).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(ParallelAttention(block.attn, 0, 1)(x), block.attn(x))
    for seq_par in (False, True):
        torch.testing.assert_close(
            sp.ParallelBlock(block, 0, 1, sequence_parallel=seq_par)(x),
            block(x),
            rtol=1e-12,
            atol=1e-12,
        )


def test_one_rank_gpt_is_tinygpt_with_the_same_names():
    torch.manual_seed(0)
    model = TinyGPT(d_model=16, n_heads=4, n_layers=2, seq_len=8).double()
    par = ParallelGPT(model, 0, 1, sequence_parallel=True)
    idx = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(par(idx), model(idx), rtol=1e-12, atol=1e-12)
    assert [n for n, _ in par.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert sp.sequence_parallel_parameters(par) == []  # one rank: nothing to reduce


def test_heads_not_divisible_by_the_ranks_is_refused():
    with pytest.raises(ValueError, match=r"n_heads=4 is not divisible .* world size 3"):
        ParallelAttention(CausalSelfAttention(16, 4), 0, 3)


def test_two_ranks_without_a_process_group_say_how_to_get_one():
    attn = ParallelAttention(CausalSelfAttention(16, 4), 0, 2)
    with pytest.raises(RuntimeError, match="torchrun"):
        attn(torch.randn(1, 4, 16))
    with pytest.raises(RuntimeError, match="torchrun"):
        sp.gather_from_sequence(torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match=r"whole input \[B, T, 16\]"):
        attn(torch.randn(4, 16))


def test_the_group_check_runs_alone_refuses_what_needs_a_group_and_a_wrong_world():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    assert group_rank_and_size() == (0, 1)  # alone: a world of one
    with pytest.raises(RuntimeError, match="ring attention needs a process group.*torchrun"):
        group_rank_and_size(needed_for="ring attention")
    tp.ColumnParallelLinear(nn.Linear(4, 4), 1, 2)  # any rank's layer, to test it alone
    with runtime.distributed(backend="gloo", device="cpu", group_of_one=True):
        assert group_rank_and_size(needed_for="a test") == (0, 1)
        with pytest.raises(ValueError, match=r"world_size=2 .* \(rank 0 of 1\): pass ctx.rank"):
            tp.ColumnParallelLinear(nn.Linear(4, 4), 0, 2)


def test_region_seeds_agree_where_replicated_and_differ_where_sharded():
    assert sp.region_seed(5, 0, sharded=False) == sp.region_seed(5, 3, sharded=False) == 5
    assert len({sp.region_seed(5, r, sharded=True) for r in range(4)}) == 4
    assert 5 not in {sp.region_seed(5, r, sharded=True) for r in range(4)}


def test_parallel_rng_keeps_its_own_state_and_leaves_the_default_one_alone():
    torch.manual_seed(3)
    rng = tp.ParallelRNG(rank=1)
    assert rng.seed == 3
    outside = torch.get_rng_state()
    with rng.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)  # the replicated regions' stream
    with rng.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the state moved on: no mask repeats
    want = torch.Generator().manual_seed(sp.region_seed(3, 1, sharded=True))
    torch.testing.assert_close(first, torch.rand(4, generator=want), rtol=0, atol=0)
    other = tp.ParallelRNG(3, rank=0)
    with other.fork():
        assert not torch.equal(torch.rand(4), first)  # another rank, other numbers


def test_one_rank_with_dropout_draws_what_the_plain_block_draws():
    torch.manual_seed(0)
    block = Block(16, 4, dropout=0.3, flash=False).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    for seq_par in (False, True):
        par = sp.ParallelBlock(block, 0, 1, sequence_parallel=seq_par)
        torch.manual_seed(5)
        want = block(x)
        torch.manual_seed(5)
        torch.testing.assert_close(par(x), want, rtol=1e-12, atol=1e-12)
