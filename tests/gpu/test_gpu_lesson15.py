"""Lesson 15 on this machine's GPUs: ``15_context_parallel.py`` and ``15_moe.py`` as plain
``python`` (a group of one: nccl on ``cuda:0``), ring attention in bfloat16 on a GPU
against float64 and against the GPU's own ``scaled_dot_product_attention``, and with 2 or
4 GPUs the notebook's torchrun jobs of both scripts (nccl, one rank per GPU) and ring
attention's passes overlapped with its blocks against waited for at once (timed).

Skipped, with the reason, on a machine without a GPU (or with too few); ``python -m
ddp_course gpu-check`` runs this file and keeps the results. Each test takes a few seconds
on a GPU, mostly process start-up.
"""

import gc
import math

import pytest
import torch
import torch.distributed as dist
from gpu_support import RANKS, keep, needs_2_gpus, needs_4_gpus, needs_gpu, run, run_plain

from ddp_course import context_parallel as cp
from ddp_course.harness import launch

pytestmark = pytest.mark.serial

# Small settings; 12 heads divide any world size from 1 to 4 (Ulysses splits the heads).
CP_ARGS = [
    "--batch-size",
    "2",
    "--n-heads",
    "12",
    "--t-local",
    "4",
    "--head-dim",
    "4",
    "--chunks",
    "1",
    "4",
]
# Notebook 15's jobs, with its parameters cell's settings.
NOTEBOOK_CP_ARGS = ["--batch-size", "2", "--n-heads", "4", "--t-local", "16", "--head-dim", "8"]
NOTEBOOK_MOE_ARGS = [
    "--d-model",
    "16",
    "--hidden",
    "32",
    "--experts",
    "4",
    "--k",
    "2",
    "--tokens",
    "24",
    "--capacity-factor",
    "1.0",
]
BF16_ROUNDING = 2.0**-8  # bfloat16: rounding x once moves it by at most 2^-8 |x|


def check_context_parallel(r: dict, world_size: int) -> None:
    """What notebook 15 asserts of the job, on CUDA with nccl."""
    assert r["device"].startswith("cuda") and r["meta"]["backend"] == "nccl", r["meta"]
    assert r["world_size"] == world_size
    for name, d in r["diffs"].items():  # float32 meets CUDA's SDPA kernels in the reference
        assert max(d.values()) <= (1e-12 if "float64" in name else 1e-5), (name, d)
    elems = math.prod(r["local_shape"])
    for counts in r["counts"]:
        assert counts["ring contiguous"]["bytes"] == 2 * (world_size - 1) * elems * 4
        assert counts["ulysses"]["bytes"] == 4 * (world_size - 1) * elems * 4 // world_size
        # Backward: K, V P-1 times and their accumulators P times; Ulysses as forward.
        ring_back = (4 * world_size - 2) * elems * 4 if world_size > 1 else 0
        assert counts["ring contiguous"]["backward_bytes"] == ring_back
        assert counts["ulysses"]["backward_bytes"] == counts["ulysses"]["bytes"]
    m = r["mistakes"]
    assert max(m["documents masked"].values()) <= 1e-12
    for name, d in m.items():
        if "all_gather" in name or "gather_sequence" in name:
            # nccl: torch's all_gather backward is a reduce-scatter of contiguous copies.
            assert max(d.values()) <= 1e-12, (name, d)
    theirs = r["torch_context_parallel"]
    assert theirs["ran"] and theirs["max_diff"] <= 1e-3, theirs  # float32 on a GPU kernel
    assert theirs["ranks"] == world_size  # on CUDA every rank takes part
    assert theirs["default_rotate_method"] in (None, "ALL_GATHER"), theirs
    beyond = {a: max(row["beyond_one_rounding"].values()) for a, row in r["ring_bf16"].items()}
    assert beyond["float32"] <= 1e-5 and beyond["bfloat16"] > 1e-3, beyond
    assert all(row["float32"] < 1e-5 for row in r["bf16_sweep"])


def check_moe(r: dict, world_size: int) -> None:
    assert r["device"].startswith("cuda") and r["meta"]["backend"] == "nccl", r["meta"]
    assert r["world_size"] == world_size
    assert max(r["diffs"].values()) <= 1e-12, r["diffs"]
    assert max(r["torch_diffs"].values()) <= 1e-12, r["torch_diffs"]
    for p in r["per_rank"]:
        assert p["measured_bytes_to_others"][0] == p["routing_bytes_to_others"]
    assert {t["aux_weight"] for t in r["training"]} == {0.0, 0.1}
    for t in r["training"]:  # part 2's counts came back from nccl all-reduces on ctx.device
        assert len(t["routed_per_step"]) == len(t["cv_per_step"]) > 0


# ---------------------------------------------------------------- one GPU, plain python


@needs_gpu
def test_context_parallel_as_plain_python_on_a_gpu(root):
    r = run_plain(root, "15_context_parallel.py", CP_ARGS)
    keep("15_context_parallel_plain", r)
    check_context_parallel(r, 1)


@needs_gpu
def test_moe_as_plain_python_on_a_gpu(root):
    # A CPU tensor all-reduced on nccl was refused here ("No backend type associated with
    # device type cpu") before the script built it on ctx.device.
    r = run_plain(root, "15_moe.py", ["--tokens", "8", "--steps", "3"])
    keep("15_moe_plain", r)
    check_moe(r, 1)


@pytest.fixture
def nccl_group_of_one():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield device
    finally:
        gc.collect()
        dist.destroy_process_group()


def errors(got, exact):
    """Largest |got - exact| and the most it goes past 2^-8 |exact|, per tensor name."""
    out = {}
    for name, a, b in zip(["output", "dq", "dk", "dv"], got, exact):
        e = (a.double() - b).abs()
        out[name] = {
            "max_error": e.max().item(),
            "beyond_one_rounding": (e - BF16_ROUNDING * b.abs()).max().item(),
        }
    return out


@needs_gpu
def test_bf16_ring_attention_on_a_gpu_rounds_once(nccl_group_of_one):
    device = nccl_group_of_one
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(2, 8, 1024, 64, generator=gen, dtype=torch.float64)
        .to(torch.bfloat16)
        .double()
        .to(device)
        for _ in range(4)
    )
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = cp.reference_attention(*ref_in, causal=True)
    (ref * grad).sum().backward()
    exact = [ref, *(x.grad for x in ref_in)]
    results = {}
    for name, acc in (
        ("ring, float32 accumulators", None),
        ("ring, bfloat16 accumulators", torch.bfloat16),
        ("scaled_dot_product_attention", "sdpa"),
    ):
        local = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
        if acc == "sdpa":  # the GPU's own bfloat16 kernel (flash or memory-efficient)
            out = torch.nn.functional.scaled_dot_product_attention(*local, is_causal=True)
        else:
            out = cp.ring_attention(*local, causal=True, accumulate_dtype=acc)
        (out.double() * grad).sum().backward()
        results[name] = errors([out, *(x.grad for x in local)], exact)
    keep(
        "15_ring_attention_bf16",
        {"device": torch.cuda.get_device_name(device), "shape": list(q.shape), "errors": results},
    )
    ours = results["ring, float32 accumulators"]
    assert max(e["beyond_one_rounding"] for e in ours.values()) <= 1e-5, results
    bf16 = results["ring, bfloat16 accumulators"]
    assert max(e["beyond_one_rounding"] for e in bf16.values()) > 1e-3, results


# ---------------------------------------------------------------- 2 and 4 GPUs, torchrun


@needs_2_gpus
def test_context_parallel_with_one_rank_per_gpu(root):
    r = run(root, "15_context_parallel.py", CP_ARGS)  # nproc = RANKS, one GPU each
    keep("15_context_parallel", r)
    check_context_parallel(r, RANKS)


@needs_2_gpus
def test_moe_notebook_job_on_two_gpus(root):
    r = run(root, "15_moe.py", NOTEBOOK_MOE_ARGS, nproc=2)  # notebook 15's job (EP_RANKS)
    keep("15_moe_2gpus", r)
    check_moe(r, 2)
    assert sum(r["reference_dropped"]) > 0


@needs_4_gpus
def test_context_parallel_notebook_job_on_four_gpus(root):
    r = run(root, "15_context_parallel.py", NOTEBOOK_CP_ARGS, nproc=4)  # notebook 15's job
    keep("15_context_parallel_4gpus", r)
    check_context_parallel(r, 4)


@needs_2_gpus
def test_ring_attention_overlap_on_gpus(root):
    # Each pass posted before the step's blocks and waited for after them, against waited
    # for at once: the same results bit for bit; the time the overlap saves is recorded.
    args = [
        "--t-local",
        "2048",
        "--n-heads",
        "16",
        "--head-dim",
        "64",
        "--dtype",
        "bfloat16",
        "--repeats",
        "5",
    ]
    r = launch.torchrun(
        root / "tests/workers/ring_overlap_check.py",
        args,
        nproc=RANKS,
        results=True,
        echo=False,
        timeout_s=300,
    ).results
    keep("15_ring_overlap", r)
    assert r["device"].startswith("cuda") and r["backend"] == "nccl", r
    assert r["equal"], r
    assert r["overlapped_over_waited"] <= 1.25, r  # posting early costs nothing
