"""Megatron-LM tensor parallelism (Shoeybi et al. 2019) against one process, on 2 and 4 gloo ranks;
all-reduces counted by wrapping dist.all_reduce and by CommDebugMode; two mistakes caught;
PyTorch's parallelize_module equal to ours; bad sizes refused.
"""

import pytest
import torch
import worker_jobs
from torch import nn

from ddp_course.models import FeedForward
from ddp_course.tensor_parallel import ColumnParallelLinear, ParallelFeedForward, RowParallelLinear

D_MODEL, HIDDEN, BATCH, BLOCKS, STEPS = 8, 24, 6, 2, 3
ARGS = [
    "--d-model",
    str(D_MODEL),
    "--hidden",
    str(HIDDEN),
    "--batch-size",
    str(BATCH),
    "--blocks",
    str(BLOCKS),
    "--steps",
    str(STEPS),
]


job = worker_jobs.worker_fixture("tensor_parallel_check.py", ARGS, world_sizes=[2, 4])


def test_parallel_mlp_equals_one_process(job):
    # Output, input gradient, every gathered weight gradient, and the gathered
    # weights after SGD steps: assert_close against the single-process MLP, on every rank.
    for rank, report in enumerate(job["variants"]["as_written"]):
        assert report["fails"], "the worker checked nothing"
        assert worker_jobs.failed(report) == {}, f"rank {rank}"
    checked = set(job["variants"]["as_written"][0]["fails"])
    assert {"output", "input_grad", f"grad {BLOCKS - 1}.fc2.bias"} <= checked
    assert f"after {STEPS + 1} SGD steps 0.fc1.weight" in checked


def test_one_all_reduce_per_block_each_way_of_batch_x_d_model_floats(job):
    for report in job["variants"]["as_written"]:
        assert report["counts"] == {"forward": BLOCKS, "backward": BLOCKS}
        # [batch, d_model] float32, whatever the number of ranks: the output in
        # forward (g), the input gradient in backward (f).
        assert [c["bytes"] for c in report["calls"]] == [BATCH * D_MODEL * 4] * (2 * BLOCKS)
        assert {c["dtype"] for c in report["calls"]} == {"torch.float32"}
        assert report["calls"][0]["shape"] == [BATCH, D_MODEL]


def test_each_rank_holds_its_share_of_the_weights(job):
    n = job["world_size"]
    report = job["variants"]["as_written"][0]
    per_block = HIDDEN * D_MODEL + HIDDEN + D_MODEL * HIDDEN + D_MODEL
    assert report["params_whole"] == BLOCKS * per_block
    # 1/N of everything but fc2's bias, which every rank keeps whole.
    shard = (HIDDEN * D_MODEL + HIDDEN + D_MODEL * HIDDEN) // n + D_MODEL
    assert report["params_per_rank"] == BLOCKS * shard


def test_f_without_its_backward_all_reduce_is_caught(job):
    for report in job["variants"]["f_backward_without_all_reduce"]:
        fails = worker_jobs.failed(report)
        assert report["counts"] == {"forward": BLOCKS, "backward": 0}
        # The forward is still right: only gradients reveal the mistake, those of
        # the first block and the input (the last block's input gradient is what is lost).
        assert "output" not in fails
        assert {"input_grad", "grad 0.fc1.weight", "grad 0.fc2.weight"} <= set(fails)
        assert f"grad {BLOCKS - 1}.fc2.weight" not in fails
        assert "one all-reduce per block in backward" in fails


def test_bias_added_on_every_rank_is_caught(job):
    for report in job["variants"]["bias_added_on_every_rank"]:
        fails = worker_jobs.failed(report)
        # The communication is as it should be: counting alone would not catch this.
        assert report["counts"] == {"forward": BLOCKS, "backward": BLOCKS}
        assert "output" in fails and f"grad {BLOCKS - 1}.fc2.bias" in fails


def test_parallelize_module_equals_ours_with_the_same_collectives(job):
    for report in job["torch"]:
        fails = report["fails"]
        assert len(fails) == 2 + 4 * BLOCKS
        assert worker_jobs.failed(report) == {}
        assert "grad 0.fc1.weight (Shard)" in fails and "grad 0.fc2.bias (Replicate)" in fails
        ours, theirs = report["counts"]["ours"], report["counts"]["torch"]
        # CommDebugMode sees our c10d all-reduces and DTensor's functional ones alike.
        assert ours["forward"] == ours["backward"] == {"c10d.allreduce_": BLOCKS}
        assert theirs["forward"] == theirs["backward"] == {"c10d_functional.all_reduce": BLOCKS}
        assert ours["forward_total"] == theirs["forward_total"] == BLOCKS


# In one process, without a process group.


def full_mlp():
    torch.manual_seed(0)
    return FeedForward(D_MODEL, HIDDEN)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shards_put_back_together_are_the_whole_weights(n):
    mlp = full_mlp()
    cols = [ColumnParallelLinear(mlp.fc1, r, n) for r in range(n)]
    rows = [RowParallelLinear(mlp.fc2, r, n) for r in range(n)]
    assert cols[0].weight.shape == (HIDDEN // n, D_MODEL)
    assert rows[0].weight.shape == (D_MODEL, HIDDEN // n)
    assert torch.equal(torch.cat([c.weight for c in cols], 0), mlp.fc1.weight)
    assert torch.equal(torch.cat([c.bias for c in cols], 0), mlp.fc1.bias)
    assert torch.equal(torch.cat([r.weight for r in rows], 1), mlp.fc2.weight)
    assert all(torch.equal(r.bias, mlp.fc2.bias) for r in rows)
    # The shards are copies: training them leaves the whole model alone.
    with torch.no_grad():
        cols[0].weight.zero_()
    assert mlp.fc1.weight.abs().sum() > 0


def test_one_rank_is_the_plain_mlp():
    mlp = full_mlp()
    x = torch.randn(BATCH, D_MODEL)
    torch.testing.assert_close(ParallelFeedForward(mlp, 0, 1)(x), mlp(x))


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"hidden=10 is not divisible .*\(e\.g\. 12\)"):
        ParallelFeedForward(FeedForward(D_MODEL, 10), 0, 4)
    col = ColumnParallelLinear(nn.Linear(D_MODEL, HIDDEN), 0, 1)
    with pytest.raises(ValueError, match=r"whole input, \[\*, 8\]"):
        col(torch.randn(2, 5))
    row = RowParallelLinear(nn.Linear(HIDDEN, D_MODEL), 0, 2)
    with pytest.raises(ValueError, match=r"this rank's slice of the input, \[\*, 12\]"):
        row(torch.randn(2, HIDDEN))
    # Two ranks' worth of layer but no process group: say how to get one, do not hang.
    two = ColumnParallelLinear(nn.Linear(D_MODEL, HIDDEN), 0, 2)
    with pytest.raises(RuntimeError, match="torchrun"):
        two(torch.randn(2, D_MODEL))
