"""DDP from scratch (ddp_course.ddp) against torch's DDP and one process, on 3 gloo ranks.

One job checks every case (tests/workers/ddp_internals_equivalence.py):
bucket caps giving one bucket, two buckets and one bucket per parameter, tied
weights, a frozen layer, a layer used on every other step, no_sync, buffers,
the number of all-reduce calls, overlap timestamps and bad input.
"""

import pathlib

import pytest
import torch
import worker_jobs
from torch import nn

from ddp_course.ddp import BucketedDDP, NaiveDDP, average_gradients
from ddp_course.harness import launch

WORKERS = pathlib.Path(__file__).resolve().parents[1] / "workers"
# Tight: float32 sums of 2 or 3 terms in another order differ by a few ulp.
ATOL = 1e-6
TRAINABLE = 9  # Net's parameters that get gradients: tied weight once, frozen layer none


# 3 ranks; notebook 07 compares 2 ranks with torch's DDP on the lesson's script.
job = worker_jobs.worker_fixture("ddp_internals_equivalence.py", ["--steps", "3"], [3])


@pytest.fixture(scope="module")
def ranks(job):
    return job["per_rank"]


def test_every_rank_reports(ranks):
    assert len(ranks) == 3 and all(r["world_size"] == 3 for r in ranks)


def test_parameters_equal_torch_ddp_and_one_process(ranks):
    for r in ranks:
        assert len(r["cases"]) == 8
        for name, case in r["cases"].items():
            assert case["broadcast_ok"], f"{name}: rank 0's parameters were not broadcast"
            assert case["diff_ref"] <= ATOL, f"{name}: differs from one process on the batch"
            assert case["diff_torch"] <= ATOL, f"{name}: differs from torch's DDP"


def test_bucket_caps_tied_and_frozen(ranks):
    cases = ranks[0]["cases"]
    for usage in ("always", "sometimes"):
        assert len(cases[f"bucketed/one_bucket/{usage}"]["buckets"]) == 1
        assert len(cases[f"bucketed/two_buckets/{usage}"]["buckets"]) == 2
        per_param = cases[f"bucketed/per_param/{usage}"]["buckets"]
        assert [len(b) for b in per_param] == [1] * TRAINABLE
        names = [n for b in per_param for n in b]
        # reverse registration order; tied b.weight counted once as a.weight; frozen skipped
        assert names == [
            "head.bias",
            "head.weight",
            "sometimes.bias",
            "sometimes.weight",
            "b.bias",
            "a.bias",
            "a.weight",
            "inp.bias",
            "inp.weight",
        ]


def test_all_reduce_calls_per_step_equal_buckets(ranks):
    for r in ranks:
        for name, case in r["cases"].items():
            kind, *rest = name.split("/")
            if kind == "bucketed":
                # find_unused_parameters adds one all-reduce of the "used" flags
                extra = 1 if rest[1] == "sometimes" else 0
                assert case["calls_per_step"] == [len(case["buckets"]) + extra] * 3, name
            else:  # naive and average_gradients: one call per parameter
                assert case["calls_per_step"] == [TRAINABLE] * 3, name


def test_first_bucket_all_reduce_starts_before_backward_ends(ranks):
    for r in ranks:
        for cap in ("two_buckets", "per_param"):
            events = r["cases"][f"bucketed/{cap}/always"]["events"]
            launches = [t for kind, i, t in events if kind == "launch"]
            last_grad = max(t for kind, _, t in events if kind == "grad")
            end = [t for kind, _, t in events if kind == "end"][0]
            assert launches == sorted(launches)
            assert launches[0] < last_grad < end, f"{cap}: no overlap with backward"
        events = r["cases"]["bucketed/one_bucket/always"]["events"]
        launch_t = [t for kind, _, t in events if kind == "launch"]
        assert len(launch_t) == 1 and launch_t[0] >= max(t for k, _, t in events if k == "grad")


def test_no_sync_accumulation_equals_k_times_batch(ranks):
    for r in ranks:
        ns = r["no_sync"]
        assert ns["diff_ref"] <= ATOL and ns["diff_torch"] <= ATOL
        k = ns["k"]
        expected = ([False] * (k - 1) + [True]) * 2  # differ inside no_sync, equal after sync
        for key in ("bucketed", "torch"):
            assert ns["grads_equal_after_each_micro_step"][key] == expected, key


def test_unused_parameter_is_named(ranks):
    for r in ranks:
        for kind in ("naive", "bucketed"):
            message = r["unused_errors"][kind]
            assert message is not None, f"{kind}: no error for an unused parameter"
            assert "sometimes.weight" in message and "find_unused_parameters=True" in message


def test_broadcast_buffers_like_torch(ranks):
    for r in ranks:
        assert r["buffers"]["diff_torch"] <= ATOL
        assert r["buffers"]["running_mean_differs_across_ranks"]


def test_bad_input_across_ranks(ranks):
    for r in ranks:
        assert "bucket_cap_mb must be > 0" in r["bad_input"]["cap"]
        assert "differs from rank 0's" in r["bad_input"]["shapes"]
        assert "inp.weight" in r["bad_input"]["shapes"]


@pytest.mark.parametrize("make", [NaiveDDP, BucketedDDP, average_gradients])
def test_no_process_group_is_a_clear_error(make):
    with pytest.raises(RuntimeError, match="init_process_group"):
        make(nn.Linear(2, 2))


def test_bad_bucket_cap_before_anything_else():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedDDP(nn.Linear(2, 2), bucket_cap_mb=-1)
    assert torch.distributed.is_available()


def test_layer_unused_on_some_ranks_counts_as_zero_like_torch():
    # find_unused_parameters=True, a layer used by rank 0 only in step 1: rank
    # 1's slot must count as zero in the average (torch's DDP does so); a slot
    # left holding step 0's gradient would pass every other test here.
    run = launch.torchrun(
        WORKERS / "ddp_unused_on_some_ranks.py", nproc=2, results=True, echo=False, timeout_s=240
    )
    for rank, steps in enumerate(run.results["per_rank"]):
        assert [s["uses"] for s in steps] == [
            [True, True],
            [True, False],
            [False, False],
            [True, True],
        ]
        # Step 1 is the case: a gradient of the layer exists, from rank 0 only.
        assert steps[1]["extra_grad_norm"] > 0
        for i, step in enumerate(steps):
            worst = max(step["grad_diff"].values())
            assert worst <= ATOL, f"rank {rank}, step {i}: gradients differ by {worst}"
            assert step["param_diff"] <= ATOL, f"rank {rank}, step {i}: parameters differ"
