"""ddp_course.collectives: ring and parameter-server all-reduce from point-to-point ops.

The multi-process tests launch tests/workers/collectives_check.py once per
world size (2, 3, 4); the worker compares every result with
``dist.all_reduce`` itself (``torch.testing.assert_close``) and hands back
the bytes each rank counted, which are checked here against the formulas.
"""

import math
import pathlib

import pytest
import torch

from ddp_course import launch
from ddp_course.collectives import (
    CommStats,
    chunk_bounds,
    parameter_server_all_reduce,
    parameter_server_bytes,
    ring_all_gather,
    ring_all_reduce,
    ring_bytes,
    ring_reduce_scatter,
    ring_schedule,
    simulate_parameter_server,
)

WORKER = pathlib.Path(__file__).parent / "workers" / "collectives_check.py"


# --- pure functions ---------------------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 5, 12, 13, 1001])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_chunk_bounds_cover_the_tensor_like_tensor_split(numel, n):
    bounds = chunk_bounds(numel, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    split = torch.arange(numel).tensor_split(n)
    assert [b - a for a, b in bounds] == [len(s) for s in split]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_ring_schedule_reduces_then_gathers_every_contribution(n):
    # held[r][c]: the ranks whose contribution rank r's copy of chunk c holds.
    held = [[{r} for _ in range(n)] for r in range(n)]
    for step in ring_schedule(n, "reduce_scatter"):
        sent = [set(held[r][step[r][0]]) for r in range(n)]
        for r in range(n):
            send_chunk, recv_chunk = step[(r - 1) % n][0], step[r][1]
            assert send_chunk == recv_chunk  # the left neighbour sends what r expects
            held[r][recv_chunk] |= sent[(r - 1) % n]
    assert all(held[r][r] == set(range(n)) for r in range(n))
    for step in ring_schedule(n, "all_gather"):
        sent = [set(held[r][step[r][0]]) for r in range(n)]
        for r in range(n):
            held[r][step[r][1]] = sent[(r - 1) % n]
    assert all(chunk == set(range(n)) for row in held for chunk in row)
    assert len(ring_schedule(n, "all_gather")) == n - 1
    with pytest.raises(ValueError, match="phase"):
        ring_schedule(n, "broadcast")


def test_chunk_bounds_rejects_bad_sizes():
    with pytest.raises(ValueError, match="world_size"):
        chunk_bounds(10, 0)
    with pytest.raises(ValueError, match="numel"):
        chunk_bounds(-1, 2)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_bytes_equal_the_bandwidth_optimal_formula(n):
    numel, esize = 840 * n, 4  # a multiple of n
    k = numel * esize
    for rank in range(n):
        stats = ring_bytes(numel, esize, n, rank)
        assert stats.bytes_sent == stats.bytes_received == 2 * (n - 1) * k // n
        assert stats.steps == 2 * (n - 1)


@pytest.mark.parametrize("numel", [1, 2, 7, 1001])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_bytes_for_odd_lengths_average_to_the_formula(numel, n):
    per_rank = [ring_bytes(numel, 8, n, r) for r in range(n)]
    k = numel * 8
    # Every byte sent is received: the totals match, and their mean is the formula.
    assert sum(s.bytes_sent for s in per_rank) == sum(s.bytes_received for s in per_rank)
    assert sum(s.bytes_sent for s in per_rank) == 2 * (n - 1) * k
    assert all(abs(s.bytes_sent - 2 * (n - 1) * k / n) < 2 * 8 for s in per_rank)


def test_parameter_server_bytes_at_server_and_worker():
    k = 1000 * 4
    for n in (2, 3, 4, 8):
        server = parameter_server_bytes(1000, 4, n, rank=0)
        assert server.bytes_sent == server.bytes_received == (n - 1) * k
        assert server.bytes_total == 2 * (n - 1) * k  # seed 001: T = 2(N-1)K
        worker = parameter_server_bytes(1000, 4, n, rank=n - 1)
        assert worker.bytes_sent == worker.bytes_received == k
    assert parameter_server_bytes(1000, 4, 3, rank=2, root=2).bytes_sent == 2 * k
    assert parameter_server_bytes(1000, 4, 1, rank=0) == CommStats()


def test_byte_formulas_reject_bad_ranks():
    with pytest.raises(ValueError, match="rank 3"):
        ring_bytes(10, 4, 3, 3)
    with pytest.raises(ValueError, match="root"):
        parameter_server_bytes(10, 4, 3, 0, root=-1)
    with pytest.raises(ValueError, match="element_size"):
        ring_bytes(10, 0, 3, 0)


def test_comm_stats_add():
    total = CommStats(1, 2, 3) + CommStats(10, 20, 30)
    assert total == CommStats(11, 22, 33)
    assert total.bytes_total == 33


# --- one process, no process group: world size 1 ----------------------------


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_single_process_is_the_identity(op):
    x = torch.arange(7, dtype=torch.int64)
    for fn in (ring_all_reduce, parameter_server_all_reduce):
        y = x.clone()
        assert fn(y, op) == CommStats()
        assert torch.equal(y, x)
    chunk, stats = ring_reduce_scatter(x.clone(), op)
    assert torch.equal(chunk, x) and stats == CommStats()
    assert ring_all_gather(x.clone()) == CommStats()


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="op must be one of"):
        ring_all_reduce(torch.zeros(3), op="prod")
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(torch.zeros(3, 4).t())
    with pytest.raises(ValueError, match="dtype"):
        parameter_server_all_reduce(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="torch.Tensor"):
        ring_all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="root"):
        parameter_server_all_reduce(torch.zeros(3), root=1)


# --- synchronous versus asynchronous parameter server ------------------------


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


# --- several processes: compared with dist.all_reduce inside the worker ------


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def launched(request):
    n = request.param
    result = launch.torchrun(WORKER, nproc=n, results=True, echo=False, timeout_s=180)
    return n, result.results


def test_worker_checked_every_case(launched):
    n, results = launched
    assert results["world_size"] == n
    assert results["backend"] == "gloo"
    assert results["cases"] >= 80
    # With N >= 3 the ranks 1..N-1 also ran both algorithms on a subgroup.
    assert results["subgroup_checked"] == (n - 1 if n >= 3 else None)


def test_counted_ring_bytes_equal_2_n_minus_1_over_n_k(launched):
    n, results = launched
    k = 12_000 * 4
    for rank, counted in enumerate(results["bytes"]["12000"]):
        assert counted["ring"] == [2 * (n - 1) * k // n] * 2 + [2 * (n - 1)], rank
    for rank, counted in enumerate(results["bytes"]["1001"]):
        expected = ring_bytes(1001, 4, n, rank)
        assert counted["ring"] == [expected.bytes_sent, expected.bytes_received, expected.steps]


def test_counted_parameter_server_bytes_at_server_and_workers(launched):
    n, results = launched
    k = 12_000 * 4
    server, *workers = results["bytes"]["12000"]
    assert server["ps"] == [(n - 1) * k, (n - 1) * k, 2]
    assert all(w["ps"] == [k, k, 2] for w in workers)


# --- the lesson script, as one plain process ----------------------------------


def test_script_03_runs_as_a_group_of_one(root):
    job = launch.python(root / "scripts/03_collectives.py", results=True, echo=False)
    r = job.results
    assert (r["world_size"], r["backend"]) == (1, "gloo")
    [record] = r["ranks"]
    assert "point_to_point" not in record  # skipped, and the log says so
    assert "point-to-point needs a peer" in job.output
    collectives = record["collectives"]
    assert collectives["all_reduce"] == {"before": [0, 1], "after": [0, 1]}
    assert collectives["all_to_all"] == {"before": [0], "after": [0]}
    assert r["sync_versus_async"]["async_ok"] and r["sync_versus_async"]["sync_ok"]
