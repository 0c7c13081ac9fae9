"""The collective log sees every path a collective can take, on 4 gloo ranks (a 2 x 2 mesh):
``torch.distributed``'s functions, DDP's reducer, FSDP2, DTensor, functional collectives,
``batch_isend_irecv``, compiled graphs; each is checked against tensor sizes known
beforehand or against a record made another way (a DDP communication hook, the parameters'
sizes, PyTorch's ``CommDebugMode``, the same model run eagerly)."""

import pathlib

import pytest
import torch

from ddp_course.harness import launch
from ddp_course.tools.collective_log import CollectiveLog

N = 4


@pytest.fixture(scope="module")
def ranks():
    worker = pathlib.Path(__file__).resolve().parents[1] / "workers" / "collective_log_check.py"
    job = launch.torchrun(worker, nproc=N, results=True, echo=False, timeout_s=240)
    assert job.results["world_size"] == N
    return job.results["ranks"]


def phase(rank, name):
    return [c for c in rank["calls"] if c["phase"] == name]


def brief(calls, *keys):
    return [tuple(c[k] for k in keys) for c in calls]


def test_each_torch_distributed_function_is_one_record_of_known_size(ranks):
    for r in ranks:
        expect = {
            "all_reduce": 192,
            "all_gather": 192 * N,
            "reduce_scatter": 192 * N,
            "broadcast": 192,
            "all_to_all": (r["rank"] + 1) * N * 16,
            "scatter": 192 * N,
            "gather": 192 * N,
        }
        for op, nbytes in expect.items():
            assert brief(phase(r, op), "op", "path", "bytes", "group_size", "dims") == [
                (op, "c10d", nbytes, N, "dp+tp")  # the whole job: every mesh dimension
            ], (r["rank"], op)


def test_ring_bytes_follow_the_busbw_factors(ranks):
    for r in ranks:
        ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        ring = {op: phase(r, op)[0]["ring_sent"] for op in ops}
        assert ring["all_reduce"] == 2 * (N - 1) * 192 // N
        assert ring["all_gather"] == ring["reduce_scatter"] == (N - 1) * 192
        # Rank r sends r + 1 rows of 16 bytes to each of the N - 1 others.
        assert ring["all_to_all"] == phase(r, "all_to_all")[0]["sent"]
        assert ring["all_to_all"] == r["expected"]["all_to_all_sent"]
        assert phase(r, "all_reduce")[0]["sent"] is None  # the backend's algorithm decides


def test_batch_isend_irecv_is_a_send_and_a_receive(ranks):
    for r in ranks:
        assert brief(phase(r, "p2p"), "op", "bytes", "sent") == [
            ("send", 192, 192),
            ("recv", 192, 0),
        ]


def test_functional_collectives_are_logged_with_their_group(ranks):
    for r in ranks:
        assert brief(phase(r, "functional"), "op", "path", "bytes", "dims") == [
            ("all_reduce", "functional", 192, "dp+tp")
        ]
        assert phase(r, "no collective") == []
        assert brief(phase(r, "other thread"), "op", "bytes") == [("all_reduce", 12)]


def test_ddps_reducer_is_seen_bucket_by_bucket(ranks):
    for r in ranks:
        hooked = [c["bytes"] for c in phase(r, "ddp hook") if c["op"] == "all_reduce"]
        builtin = [c["bytes"] for c in phase(r, "ddp") if c["op"] == "all_reduce"]
        # Several buckets, each the size the hook saw, and the same without the hook.
        assert len(r["ddp_hook_bytes"]) >= 2
        assert hooked == builtin == r["ddp_hook_bytes"]


def test_fsdp2_is_seen_unit_by_unit(ranks):
    for r in ranks:
        calls = phase(r, "fsdp")
        units = r["fsdp_unit_bytes"]
        # Forward gathers each unit, backward gathers it again and reduce-scatters its
        # gradient, the last unit first.
        gathers = [c["bytes"] for c in calls if c["op"] == "all_gather"]
        scatters = [c["bytes"] for c in calls if c["op"] == "reduce_scatter"]
        assert gathers == units + units[::-1] and scatters == units[::-1]
        assert {c["dims"] for c in calls} == {"dp"}
        assert r["fsdp_comm_debug"] == {
            "c10d._allgather_base_": len(gathers),
            "c10d._reduce_scatter_base_": len(scatters),
        }


def test_dtensor_collectives_match_comm_debug_mode(ranks):
    for r in ranks:
        calls = phase(r, "tp")
        assert r["tp_comm_debug"] == {"c10d_functional.all_reduce": len(calls)} and calls
        assert {(c["op"], c["path"], c["dims"]) for c in calls} == {
            ("all_reduce", "functional", "tp")
        }


def test_collectives_inside_compiled_graphs_are_logged_and_stay_compiled(ranks):
    for r in ranks:
        # One graph compiled, run twice under the log: both all-reduces seen, on tp.
        assert r["compiled_graphs"] == 1
        assert (
            brief(phase(r, "compiled function"), "op", "path", "bytes", "dims")
            == [("all_reduce", "functional", 192, "tp")] * 2
        )
        assert r["compiled_value"] == 2 * 2 + 1  # 2 ranks in tp, each adding 2 x 1.0
        # DDP around a compiled module: compiled graphs ran, and every gradient byte was
        # all-reduced over dp, as eager. The buckets differ: the compiled backward hands
        # DDP its gradients in another order, and DDP rebuilds its buckets in that order.
        assert r["ddp_compiled_graphs"] >= 1
        eager = brief(phase(r, "ddp eager"), "op", "bytes", "dims")
        assert eager == [("all_reduce", (512 * 512 + 512) * 4, "dp")] * 3
        compiled = brief(phase(r, "ddp compiled"), "op", "bytes", "dims")
        assert {(op, dims) for op, _, dims in compiled} == {("all_reduce", "dp")}
        assert sum(b for _, b, _ in compiled) == sum(b for _, b, _ in eager)


def test_recording_without_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="init_process_group"):
        with CollectiveLog().recording():
            torch.ones(1)
