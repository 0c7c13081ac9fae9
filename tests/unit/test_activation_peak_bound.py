"""step_budget.peak_bound: where an allocator's peak over a forward and backward must
lie, on made-up numbers (scripts/14_memory.py checks the CUDA peak with it on a GPU;
tests/gpu/test_gpu_lesson13_14.py runs that)."""

import pytest

from ddp_course import step_budget

TERMS = dict(
    activations=10_000, recompute=3_000, gradients=2_000, logits=1_000, largest=500, tensors=4
)


def test_the_bound_from_its_terms():
    bound = step_budget.peak_bound(**TERMS)
    assert bound.low == 10_000 + 1_000  # saved activations and the logits
    # + the recomputed region, every gradient, the logits and their two gradients,
    # an operation's two largest temporaries and 512 B of rounding per tensor.
    assert (
        bound.high == 10_000 + 3_000 + 2_000 + 3 * 1_000 + 2 * 500 + 4 * step_budget.ALLOCATOR_BLOCK
    )


def test_a_peak_inside_the_bound_passes_and_gives_its_fraction():
    bound = step_budget.peak_bound(**TERMS)
    assert bound.check(bound.low) == pytest.approx(bound.low / bound.high)
    assert bound.check(bound.high) == 1.0
    assert bound.check(12_000) == pytest.approx(12_000 / bound.high)


@pytest.mark.parametrize("peak", [0, 10_999, 21_049, 10**9])
def test_a_peak_outside_the_bound_is_refused(peak):
    # 10_999: less than the activations and logits that must be alive when forward ends;
    # 21_049: one byte more than everything that may be alive at once.
    with pytest.raises(ValueError, match="outside the predicted bound"):
        step_budget.peak_bound(**TERMS).check(peak)


def test_negative_terms_are_refused():
    with pytest.raises(ValueError, match="negative"):
        step_budget.peak_bound(**(TERMS | {"gradients": -1}))
