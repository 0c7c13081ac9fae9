"""Lesson 13's pieces that its script runs do not reach: the padded batch of the loss lab,
tokens/s with every step inside the warm-up, and the MFU's reasons to skip (on a CPU the
script never computes an MFU)."""

import statistics

import pytest
import torch

from ddp_course.mesh_runs import padded_batch
from ddp_course.tools import flops
from ddp_course.tools.mesh_counts import mfu_fields, speed

H100 = "NVIDIA H100 80GB HBM3"


def test_padded_batch_ignores_exactly_the_positions_past_each_length():
    x = torch.arange(64 * 10).view(64, 10)
    y = x + 1
    px, py = padded_batch((x, y), seed=7)
    assert torch.equal(px, x)
    real = (py != -100).sum(dim=1)
    assert real.min() == 2 and real.max() == 10  # every length in [2, T] drawn (64 draws of 9)
    for row, n in enumerate(real.tolist()):
        assert torch.equal(py[row, :n], y[row, :n])  # a prefix kept, the rest ignored
        assert (py[row, n:] == -100).all()
    assert torch.equal(padded_batch((x, y), seed=7)[1], py)  # its own generator


def test_speed_leaves_out_the_warmup_and_says_when_nothing_is_left():
    seconds = [5.0, 0.5, 0.25, 0.25]
    got = speed(seconds, warmup=1, tokens_per_step=100)
    assert got["timed_steps"] == 3 and got["seconds"] == 1.0
    assert got["tokens_per_s"] == 300 and got["median_step_s"] == statistics.median(seconds[1:])
    none = speed(seconds, warmup=4, tokens_per_step=100)
    assert none["tokens_per_s"] is None and none["seconds"] is None and none["timed_steps"] == 0
    assert none["tokens_per_s_skipped"] == "4 steps leave none after --warmup 4"


def test_mfu_is_computed_only_for_a_timed_bfloat16_run_on_a_known_gpu():
    assert mfu_fields(1e6, 4, "", "float32", None, 1e6) == {
        "mfu_skipped": flops.skip_reason("", "float32")
    }
    assert mfu_fields(None, 4, H100, "bfloat16", None, 1e6) == {
        "mfu_skipped": "MFU skipped: no step was timed"
    }
    got = mfu_fields(4e5, 4, H100, "bfloat16", None, 6e8)
    peak = flops.peak_bf16_flops(H100)
    assert got == {
        "mfu": pytest.approx(6e8 * 1e5 / peak),
        "flops_per_token": 6e8,
        "peak_flops": peak,
    }
    assert mfu_fields(4e5, 4, "Some GPU", "bfloat16", 1e15, 6e8)["peak_flops"] == 1e15
