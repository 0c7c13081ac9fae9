"""ddp_course.tools.scaling: efficiency tables, Amdahl and Gustafson fits, the step-time model,
all against synthetic data whose parameters are known."""

import numpy as np
import pytest

from ddp_course.tools.bench import AlphaBeta
from ddp_course.tools.scaling import (
    StepTimeModel,
    amdahl_speedup,
    comm_can_overlap,
    compute_slowdown,
    efficiency_table,
    exposed_comm,
    fit_amdahl,
    fit_gustafson,
    gustafson_speedup,
)


def test_laws_by_hand():
    # s = 0.1: Amdahl at N = 4 is 1 / (0.1 + 0.9 / 4) = 1 / 0.325; its limit is 1 / s = 10.
    assert amdahl_speedup(0.1, 4) == pytest.approx(1 / 0.325)
    assert amdahl_speedup(0.1, 1e12) == pytest.approx(10.0)
    assert gustafson_speedup(0.1, 4) == pytest.approx(4 - 0.3)
    assert amdahl_speedup(0.0, 8) == 8 and gustafson_speedup(1.0, 8) == 1
    with pytest.raises(ValueError, match="serial fraction"):
        amdahl_speedup(1.5, 2)


@pytest.mark.parametrize("s", [0.0, 0.05, 0.3, 0.9])
def test_fits_recover_the_serial_fraction(s):
    n = np.array([1, 2, 4, 8, 16])
    assert fit_amdahl(n, amdahl_speedup(s, n)) == pytest.approx(s, abs=1e-12)
    assert fit_gustafson(n, gustafson_speedup(s, n)) == pytest.approx(s, abs=1e-12)


def test_fits_with_noise_and_the_two_laws_disagree():
    rng = np.random.default_rng(0)
    n = np.repeat([1, 2, 4, 8], 20)
    noisy = amdahl_speedup(0.2, n) * rng.lognormal(0, 0.02, len(n))
    assert fit_amdahl(n, noisy) == pytest.approx(0.2, abs=0.02)
    # The same speed-ups read as weak scaling imply a larger serial fraction.
    assert fit_gustafson(n, noisy) > 0.4
    with pytest.raises(ValueError, match="more than one rank"):
        fit_amdahl([1, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        fit_gustafson([1, 2], [1.0, 0.0])


def test_efficiency_table_strong_and_weak():
    # Strong: global batch 64 in 1.0 s on one rank, 0.6 s on 2, 0.4 s on 4.
    strong = efficiency_table([1, 2, 4], [1.0, 0.6, 0.4], "strong", batch=64)
    assert [r["samples_per_s"] for r in strong] == pytest.approx([64, 64 / 0.6, 160])
    assert [r["speedup"] for r in strong] == pytest.approx([1, 1 / 0.6, 2.5])
    assert [r["efficiency"] for r in strong] == pytest.approx([1, 1 / 1.2, 0.625])
    # Weak: 32 per rank, 1.0 s per step at every N: perfect scaling.
    weak = efficiency_table([1, 2, 4], [1.0, 1.0, 1.0], "weak", batch=32)
    assert [r["samples_per_s"] for r in weak] == pytest.approx([32, 64, 128])
    assert [r["efficiency"] for r in weak] == pytest.approx([1, 1, 1])
    # Weak, steps twice as long at N = 2: efficiency 0.5, scaled speed-up 1.
    assert efficiency_table([2, 1], [2.0, 1.0], "weak", 8)[0]["efficiency"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one rank"):
        efficiency_table([2, 4], [1.0, 1.0], "weak", 8)
    with pytest.raises(ValueError, match="kind"):
        efficiency_table([1], [1.0], "linear", 8)


def test_exposed_comm_by_hand():
    link = AlphaBeta(alpha=1e-3, beta=1e-9)  # 1 ms + 1 ms per MB
    # Two 1 MB buckets ready at 5 and 10 ms of a 10 ms backward:
    # the first runs 5-7 ms, the second 10-12 ms: 2 ms exposed.
    assert exposed_comm([1e6, 1e6], [5e-3, 10e-3], 10e-3, link) == pytest.approx(2e-3)
    # Both ready at once at 1 ms: they queue, 1-3 then 3-5 ms: all hidden.
    assert exposed_comm([1e6, 1e6], [1e-3, 1e-3], 10e-3, link) == 0.0
    # Queueing: ready at 8 and 8.5 ms: 8-10 and 10-12: 2 ms exposed, not 0.5 ms.
    assert exposed_comm([1e6, 1e6], [8e-3, 8.5e-3], 10e-3, link) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="ready times"):
        exposed_comm([1e6], [], 1.0, link)


def test_step_time_model():
    model = StepTimeModel(forward_s=0.010, backward_s=0.020, optimizer_s=0.005)
    link = AlphaBeta(alpha=1e-3, beta=1e-9)
    assert model.ready_times([1e6, 3e6]) == pytest.approx([0.005, 0.020])
    # One bucket of 4 MB, ready at the end of backward: 5 ms, all exposed.
    assert model.predict([4e6], link, 2) == pytest.approx(0.035 + 0.005)
    # Four 1 MB buckets at 5, 10, 15, 20 ms: 5-7, 10-12, 15-17, 20-22: 2 ms exposed.
    assert model.predict([1e6] * 4, link, 2) == pytest.approx(0.035 + 0.002)
    # Many tiny buckets pay alpha each: 400 of 10 kB queue up to 20 + 400 * 1.01 ms.
    assert model.exposed([1e4] * 400, link, 2) == pytest.approx(400 * 1.01e-3 - 0.02 + 5e-5)
    # One rank communicates nothing.
    assert model.predict([4e6], link, 1) == pytest.approx(0.035)
    with pytest.raises(ValueError, match="no bytes"):
        model.ready_times([0, 0])


def test_step_time_model_without_overlap():
    # Communication on the cores backward needs: every bucket's time adds after backward.
    model = StepTimeModel(forward_s=0.010, backward_s=0.020, optimizer_s=0.005, overlap=False)
    link = AlphaBeta(alpha=1e-3, beta=1e-9)
    assert model.ready_times([1e6, 3e6]) == pytest.approx([0.020, 0.020])
    # Four 1 MB buckets: 4 x 2 ms exposed, where the overlapped model above hid all but 2 ms.
    assert model.exposed([1e6] * 4, link, 2) == pytest.approx(0.008)
    assert model.predict([1e6] * 4, link, 2) == pytest.approx(0.035 + 0.008)
    assert model.predict([1e6] * 4, link, 1) == pytest.approx(0.035)


def test_comm_can_overlap():
    assert comm_can_overlap("cuda", 8, 4, 2)  # NCCL has a stream of its own
    assert not comm_can_overlap("cpu", 2, 1, 2)  # every core computes
    assert not comm_can_overlap("cpu", 4, 1, 2)
    assert comm_can_overlap("cpu", 2, 1, 4)  # two cores left for gloo
    assert not comm_can_overlap("cpu", 2, 2, 4)
    with pytest.raises(ValueError, match=">= 1"):
        comm_can_overlap("cpu", 2, 0, 2)


def test_fits_at_their_bound_unclipped():
    # A slow-down (speed-ups below 1) needs s > 1, outside Amdahl's law: clipped to 1.
    n, slow = [1, 2, 4], [1.0, 0.5, 0.3]
    raw = fit_amdahl(n, slow, clip=False)
    assert raw > 1 and fit_amdahl(n, slow) == 1.0
    # By hand: x = 1 - 1/N = (0.5, 0.75), y = 1/S - 1/N = (1.5, 3.0833); s = x.y / x.x.
    x, y = np.array([0.5, 0.75]), np.array([2 - 0.5, 1 / 0.3 - 0.25])
    assert raw == pytest.approx(x @ y / (x @ x))
    # Super-linear speed-ups need s < 0: clipped to 0.
    assert fit_amdahl([1, 2], [1.0, 2.5], clip=False) < 0 == fit_amdahl([1, 2], [1.0, 2.5])
    # Weak scaling with no gain at all: N - S = N - 1, so s = 1 exactly, clipped or not.
    assert fit_gustafson([1, 2, 4], [1.0, 1.0, 1.0], clip=False) == pytest.approx(1.0)
    assert fit_gustafson([1, 2, 4], [1.0, 0.9, 0.8], clip=False) > 1


def test_compute_slowdown_and_a_slowed_model():
    assert compute_slowdown("cuda", 8, 4, 2) == 1.0  # a GPU per rank
    assert compute_slowdown("cpu", 2, 1, 2) == 1.0  # a core per rank
    assert compute_slowdown("cpu", 4, 1, 2) == 2.0  # two ranks per core
    assert compute_slowdown("cpu", 2, 2, 2) == 2.0  # two threads per core
    assert compute_slowdown("cpu", 3, 1, 2) == 1.5
    assert compute_slowdown("cpu", 1, 1, 8) == 1.0  # idle cores do not speed a rank up
    with pytest.raises(ValueError, match=">= 1"):
        compute_slowdown("cpu", 0, 1, 2)
    model = StepTimeModel(0.010, 0.020, 0.005, overlap=False)
    twice = model.slowed(2.0)
    assert (twice.forward_s, twice.backward_s, twice.optimizer_s) == pytest.approx(
        (0.020, 0.040, 0.010)
    )
    assert twice.overlap is False
    link = AlphaBeta(alpha=1e-3, beta=1e-9)
    # The compute doubles; the communication (4 buckets of 2 ms, after backward) does not.
    assert twice.predict([1e6] * 4, link, 2) == pytest.approx(0.070 + 0.008)
    with pytest.raises(ValueError, match="> 0"):
        model.slowed(0.0)
