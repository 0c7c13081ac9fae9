"""Ring attention's accumulators: float32 for bfloat16 inputs, results in the inputs' dtype.

One process (a gloo group of one); 2-4 ranks: tests/multiprocess/test_context_parallel.py.
Bound: with float32 accumulators the output and the q, k, v gradients are rounded to
bfloat16 once, at the end, so every element lies within one bfloat16 rounding,
2^-8 |exact|, of float64 on the same bfloat16 values (measured: at most 5e-8 past it at
T = 256, float32's own rounding). With bfloat16 accumulators (every merge and the saved
log-sum-exp rounded) the same run goes 1e-2 to 3e-2 past it.
"""

import pytest
import torch

from ddp_course import context_parallel as cp

BF16_ROUNDING = 2.0**-8  # 8 significant bits: rounding x moves it by at most 2^-8 |x|


def beyond_one_rounding(accumulate_dtype, t=256, layout="contiguous"):
    """Most that |ring - exact| goes past 2^-8 |exact|, for the output and dq, dk, dv."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(2, 4, t, 16, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
        for _ in range(4)
    )
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = cp.reference_attention(*ref_in, causal=True)
    (ref * grad).sum().backward()
    local = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out = cp.ring_attention(*local, layout=layout, accumulate_dtype=accumulate_dtype)
    (out.double() * grad).sum().backward()
    got = [out, *(x.grad for x in local)]
    assert [g.dtype for g in got] == [torch.bfloat16] * 4  # rounded back to the inputs' dtype
    exact = [ref, *(x.grad for x in ref_in)]
    return {
        name: ((a.double() - b).abs() - BF16_ROUNDING * b.abs()).max().item()
        for name, a, b in zip(["output", "dq", "dk", "dv"], got, exact)
    }


def test_accumulators_are_float32_or_wider():
    assert cp.accumulator_dtype(torch.bfloat16) == torch.float32
    assert cp.accumulator_dtype(torch.float16) == torch.float32
    assert cp.accumulator_dtype(torch.float32) == torch.float32
    assert cp.accumulator_dtype(torch.float64) == torch.float64


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_bfloat16_ring_rounds_once_with_float32_accumulators(group, layout):
    default, explicit = (
        beyond_one_rounding(None, layout=layout),
        beyond_one_rounding(torch.float32, layout=layout),
    )
    assert max(default.values()) <= 1e-6, default
    assert default == explicit  # float32 is the default for bfloat16 inputs


def test_bfloat16_accumulators_fail_that_bound(group):
    beyond = beyond_one_rounding(torch.bfloat16)
    assert min(beyond.values()) > 1e-3, beyond


def test_float64_still_exact(group):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    out = cp.ring_attention(q, k, v)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, cp.reference_attention(q, k, v), rtol=1e-12, atol=1e-12)
