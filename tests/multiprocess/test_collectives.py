"""ddp_course.collectives: ring and parameter-server all-reduce from point-to-point ops.

The byte formulas are tested in test_comm_cost.py, the asynchronous
parameter-server simulation in test_parameter_server.py.

The multi-process tests launch tests/workers/collectives_check.py once per
world size (2, 3, 4); the worker compares every result with
``dist.all_reduce`` itself (``torch.testing.assert_close``) and hands back
the bytes each rank counted, which are checked here against the formulas.
"""

import pathlib

import pytest
import torch

from ddp_course import runtime
from ddp_course.collectives import (
    parameter_server_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_schedule,
)
from ddp_course.comm_cost import CommStats, ring_bytes
from ddp_course.harness import launch

WORKER = pathlib.Path(__file__).resolve().parents[1] / "workers" / "collectives_check.py"


# --- pure functions ---------------------------------------------------------


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


# --- several processes: compared with dist.all_reduce inside the worker ------


# 3 ranks, uneven chunks; notebook 04 checks the ring at 2, 3 and 4 ranks on its script.
@pytest.fixture(scope="module", params=[3], ids=lambda n: f"N={n}")
def launched(request):
    n = request.param
    result = launch.torchrun(WORKER, nproc=n, results=True, echo=False, timeout_s=180)
    return n, result.results


def test_worker_checked_every_case(launched):
    n, results = launched
    assert results["world_size"] == n
    # The launcher's device plan: nccl where every rank has a GPU, else gloo.
    assert results["backend"] == runtime.device_plan(n, runtime.gpu_count()).backend
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
    assert (r["world_size"], r["backend"]) == (
        1,
        runtime.device_plan(1, runtime.gpu_count()).backend,
    )
    [record] = r["ranks"]
    assert "point_to_point" not in record  # skipped, and the log says so
    assert "point-to-point needs a peer" in job.output
    collectives = record["collectives"]
    assert collectives["all_reduce"] == {"before": [0, 1], "after": [0, 1]}
    a2a = collectives["all_to_all"]
    assert (a2a["before"], a2a["after"]) == ([0], [0])
    assert r["sync_versus_async"]["async_ok"] and r["sync_versus_async"]["sync_ok"]
