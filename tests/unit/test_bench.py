"""ddp_course.tools.bench: the pure functions (busbw factors, alpha-beta fit, summaries), and
scripts/04_allreduce.py with a tiny sweep."""

import math
import time

import numpy as np
import pytest

from ddp_course.runtime import DistContext
from ddp_course.tools import bench
from ddp_course.tools.bench import (
    COLLECTIVES,
    AlphaBeta,
    algbw,
    busbw,
    busbw_factor,
    busbw_plateau,
    fit_alpha_beta,
    fit_each,
    format_bytes,
    message_sizes,
    parameter_server_time,
    predicted_busbw,
    ring_all_reduce_time,
    scaling_efficiency,
    slowest_rank,
    summarize,
    time_interleaved,
    time_op,
    timing,
)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_busbw_factors_follow_nccl_tests(n):
    assert busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for name in ("reduce_scatter", "all_gather", "all_to_all"):
        assert busbw_factor(name, n) == pytest.approx((n - 1) / n)
    for name in ("broadcast", "reduce", "sendrecv"):
        assert busbw_factor(name, n) == 1.0


def test_busbw_of_a_known_case():
    # 1 GB all-reduced in 1 s over 8 ranks: algbw 1 GB/s, busbw 1.75 GB/s.
    assert algbw(1e9, 1.0) == 1e9
    assert busbw(1e9, 1.0, "all_reduce", 8) == pytest.approx(1.75e9)
    assert busbw(2**20, 0.5, "all_gather", 2) == pytest.approx(2**20)


def test_bandwidth_functions_reject_bad_input():
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("allreduce", 2)
    with pytest.raises(ValueError, match="world_size"):
        busbw_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="seconds"):
        algbw(10, 0.0)


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_alpha_and_beta_exactly(relative):
    alpha, bandwidth = 350e-6, 1.1e9
    sizes = message_sizes(4096, 64 * 2**20)
    times = [alpha + s / bandwidth for s in sizes]
    fit = fit_alpha_beta(sizes, times, relative=relative)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.half_bandwidth_bytes == pytest.approx(alpha * bandwidth, rel=1e-6)


def test_fit_recovers_alpha_and_beta_from_noisy_data():
    rng = np.random.default_rng(0)
    alpha, beta = 400e-6, 1 / 0.9e9
    sizes = np.repeat(message_sizes(4096, 64 * 2**20), 5)
    times = (alpha + beta * sizes) * rng.lognormal(0.0, 0.05, size=len(sizes))
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.beta == pytest.approx(beta, rel=0.05)
    # Ordinary least squares is decided by the largest sizes: alpha is far off.
    ols = fit_alpha_beta(sizes, times, relative=False)
    assert abs(ols.alpha - alpha) > abs(fit.alpha - alpha)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="distinct"):
        fit_alpha_beta([10, 10], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        fit_alpha_beta([10, 20], [1.0, 0.0])
    with pytest.raises(ValueError, match="length"):
        fit_alpha_beta([10, 20, 30], [1.0, 2.0])


def test_alpha_beta_predict():
    model = AlphaBeta(alpha=1e-3, beta=1e-9)
    assert model.predict(1e6) == pytest.approx(2e-3)
    assert np.allclose(model.predict(np.array([0, 1e9])), [1e-3, 1.001])
    assert AlphaBeta(1e-3, 0.0).bandwidth == math.inf


def test_cost_models_match_the_formulas():
    link = AlphaBeta(alpha=1e-4, beta=1e-9)
    s = 64e6
    for n in (2, 3, 4, 8):
        ring = 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * s * 1e-9
        assert ring_all_reduce_time(s, n, link) == pytest.approx(ring)
        assert parameter_server_time(s, n, link) == pytest.approx(2e-4 + 2 * (n - 1) * s * 1e-9)
    assert ring_all_reduce_time(s, 1, link) == 0.0
    assert parameter_server_time(s, 1, link) == 0.0
    # The server's cost grows with N; the ring's tends to 2 S beta.
    assert parameter_server_time(s, 8, link) > 3 * ring_all_reduce_time(s, 8, link)


def test_summarize_gives_median_and_quartiles():
    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median, t.q1, t.q3, t.min, t.repeats) == (3.0, 2.0, 4.0, 1.0, 5)
    assert t.iqr == 2.0
    one = summarize([0.25])
    assert one.median == one.q1 == one.q3 == 0.25
    with pytest.raises(ValueError):
        summarize([])


def test_scaling_efficiency():
    assert scaling_efficiency(100.0, 380.0, 4, "weak") == pytest.approx(0.95)
    assert scaling_efficiency(10.0, 2.5, 4, "strong") == pytest.approx(1.0)
    assert scaling_efficiency(10.0, 5.0, 4, "strong") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="kind"):
        scaling_efficiency(1.0, 1.0, 2, "linear")


def test_message_sizes_and_format_bytes():
    assert message_sizes(4096, 65536, 4) == [4096, 16384, 65536]
    assert message_sizes(1, 1) == [1]
    with pytest.raises(ValueError):
        message_sizes(8, 4)
    assert format_bytes(4096) == "4 KiB"
    assert format_bytes(64 * 2**20) == "64 MiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"


def test_time_op_single_process_counts_calls():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)  # sleeps at least this long: the timed window must contain it

    times = time_op(fn, DistContext(), warmup=3, repeats=4)
    assert len(calls) == 7
    assert len(times) == 4 and min(times) >= 0.002
    with pytest.raises(ValueError):
        time_op(lambda: None, DistContext(), repeats=0)


def test_time_interleaved_rotates_the_order_and_skips_inactive_settings():
    order = []
    settings = {name: (lambda name=name: order.append(name)) for name in "abc"}
    progress = []
    times = time_interleaved(
        settings,
        DistContext(),
        warmup=1,
        repeats=3,
        active=lambda name: name != "c",
        progress=lambda: progress.append(1),
    )
    assert order[:2] == ["a", "b"]  # warm-up, "c" inactive
    assert order[2:] == ["a", "b", "b", "a", "a", "b"]  # abc, bca, cab without c
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3} and len(progress) == 9
    with pytest.raises(ValueError):
        time_interleaved(settings, DistContext(), repeats=0)


def test_slowest_rank_takes_the_maximum_per_iteration():
    # Rank 1 straggles in iteration 0, rank 0 in iteration 2: each iteration is its slowest.
    assert slowest_rank([[0.1, 0.2, 0.9], [0.5, 0.2, 0.3]]) == [0.5, 0.2, 0.9]
    assert summarize(slowest_rank([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]])).median == 1.0
    with pytest.raises(ValueError, match="same iterations"):
        slowest_rank([[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="no ranks"):
        slowest_rank([])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_collective_fit_gives_its_busbw_plateau(n):
    # Synthetic sweeps with known latency and algbw per collective, as the benchmark records them.
    truth = {
        "all_reduce": (300e-6, 1.0e9),
        "all_gather": (200e-6, 2.0e9),
        "reduce_scatter": (250e-6, 1.5e9),
        "broadcast": (100e-6, 3.0e9),
        "all_to_all": (400e-6, 0.5e9),
    }
    assert set(truth) == set(COLLECTIVES)
    sizes = message_sizes(4096, 64 * 2**20)
    rows = [
        {"collective": c, "bytes": s, "median_s": a + s / bw}
        for c, (a, bw) in truth.items()
        for s in sizes
    ]
    fits = fit_each(rows)
    assert list(fits) == list(truth)
    for c, (a, bw) in truth.items():
        assert fits[c].alpha == pytest.approx(a, rel=1e-6)
        assert fits[c].bandwidth == pytest.approx(bw, rel=1e-6)
        plateau = busbw_plateau(fits[c], c, n)
        assert plateau == pytest.approx(bw * busbw_factor(c, n))
        bus = predicted_busbw(fits[c], np.array(sizes, dtype=float), c, n)
        measured = [busbw(s, a + s / bw, c, n) for s in sizes]
        assert np.allclose(bus, measured)
        assert np.all(np.diff(bus) > 0) and bus[-1] < plateau  # rises towards the plateau
        half = fits[c].half_bandwidth_bytes
        assert predicted_busbw(fits[c], half, c, n) == pytest.approx(plateau / 2)
    # min_bytes leaves the small sizes out of the fit.
    bent = [dict(r, median_s=1.0) if r["bytes"] < 16384 else r for r in rows]
    assert fit_each(bent, min_bytes=16384)["all_reduce"].alpha == pytest.approx(300e-6)
    with pytest.raises(ValueError, match="no field"):
        fit_each([{"bytes": 1, "median_s": 1.0}])


def test_runnable_tasks_reads_the_running_count(monkeypatch):
    # Linux's /proc/loadavg: "1min 5min 15min running/total last_pid"; the reader is running.
    monkeypatch.setattr(timing.pathlib.Path, "exists", lambda self: True)
    monkeypatch.setattr(timing.pathlib.Path, "read_text", lambda self: "0.50 0.40 0.30 3/100 123\n")
    assert bench.runnable_tasks(0.0, 4) == 2.0
    monkeypatch.setattr(timing.pathlib.Path, "read_text", lambda self: "0.50 0.40 0.30 1/100 123\n")
    assert bench.runnable_tasks(0.0, 1) == 0.0  # only the reader: nothing else busy
    with pytest.raises(ValueError, match="samples"):
        bench.runnable_tasks(1.0, 0)


def test_runnable_tasks_on_this_machine():
    busy = bench.runnable_tasks(0.05, 2)
    assert busy is None or busy >= 0
