"""ddp_course.parameter_server: synchronous against asynchronous parameter-server SGD."""

import math

import pytest

from ddp_course.parameter_server import simulate_parameter_server


def test_async_staleness_diverges_where_sync_converges():
    sync = simulate_parameter_server("sync", lr=0.3, rounds=60)
    fresh = simulate_parameter_server("async", staleness=0, lr=0.3, rounds=60)
    stale = simulate_parameter_server("async", lr=0.3, rounds=60)  # staleness N-1 = 3
    assert len(sync) == len(stale) == 61
    assert sync[-1] < 0.02 * sync[0]
    assert fresh[-1] < 0.02 * fresh[0]
    assert math.isinf(stale[-1])


def test_async_staleness_slows_convergence_at_a_smaller_learning_rate():
    sync = simulate_parameter_server("sync", lr=0.15, rounds=40)
    stale = simulate_parameter_server("async", lr=0.15, rounds=40)
    assert math.isfinite(stale[-1])
    assert stale[10] > sync[10]


def test_simulation_is_deterministic_and_validates():
    assert simulate_parameter_server("async", rounds=5) == simulate_parameter_server(
        "async", rounds=5
    )
    with pytest.raises(ValueError, match="mode"):
        simulate_parameter_server("hogwild")
    with pytest.raises(ValueError, match="staleness"):
        simulate_parameter_server("sync", staleness=2)
    with pytest.raises(ValueError, match="lr"):
        simulate_parameter_server("async", lr=0.0)
