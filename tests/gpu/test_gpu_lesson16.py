"""Lesson 16 on this machine's GPUs: ``16_compile.py`` and ``16_compile_mesh.py`` as plain
``python`` (a group of one: nccl on ``cuda:0``) and, with 2 GPUs or more, the notebook's
torchrun jobs (nccl, one rank per GPU); the part "speed" is the record of eager against
Inductor-compiled step time on a GPU.

Skipped, with the reason, on a machine without a GPU (or with too few); ``python -m
ddp_course gpu-check`` runs this file and keeps the results. The first Inductor compile
takes tens of seconds.
"""

import pytest
from gpu_support import keep, needs_2_gpus, needs_gpu, run, run_plain

pytestmark = pytest.mark.serial

TOL = 1e-12  # float64: aot_eager runs eager's kernels
LAYER = 256 * 256 * 8 + 256 * 8  # one Linear(256, 256) in float64, bytes


def check_ddp(r: dict) -> None:
    """What notebook 16 asserts of the DDP part, on CUDA with nccl."""
    assert r["device"].startswith("cuda") and r["meta"]["backend"] == "nccl", r["meta"]
    ddp = r["ddp"]
    split = ddp["DDP(compile(m))"]
    assert split["collectives"]["all_reduce"] == [2 * LAYER] * 3
    assert split["graph_parameter_bytes"] == [2 * LAYER] * 3
    assert ddp["one graph"]["all_reduces_before_input_gradient"] == 0
    assert split["all_reduces_before_input_gradient"] == 2
    assert all(v["max_param_diff_vs_eager"] <= TOL for v in ddp.values()), ddp


def check_speed(r: dict) -> None:
    s = r["speed"]
    assert r["device"].startswith("cuda"), r["device"]
    assert s["second_compile"]["cache_hits"] > 0
    assert s["eager"]["median_s"] > 0 and s["compiled"]["median_s"] > 0


@needs_gpu
def test_compile_with_ddp_as_plain_python_on_a_gpu(root):
    r = run_plain(root, "16_compile.py", ["--part", "ddp", "recompile", "--steps", "6"])
    keep("16_compile_ddp_plain", r)
    check_ddp(r)


@needs_gpu
def test_eager_against_compiled_step_time_on_a_gpu(root):
    r = run_plain(root, "16_compile.py", ["--part", "speed", "--steps", "30"])
    keep("16_compile_speed_plain", r)
    check_speed(r)


@needs_gpu
def test_fsdp2_and_tensor_parallel_compiled_as_plain_python_on_a_gpu(root):
    r = run_plain(root, "16_compile_mesh.py")
    keep("16_compile_mesh_plain", r)
    assert r["device"].startswith("cuda")
    for variant in ("per_block", "whole_model"):
        assert r["fsdp"][variant]["gap_vs_eager"] <= TOL, r["fsdp"][variant]


@needs_2_gpus
def test_the_notebooks_jobs_with_nccl(root):
    r = run(root, "16_compile.py", ["--part", "ddp", "speed", "--steps", "10"], nproc=2)
    keep("16_compile_2gpus", r)
    check_ddp(r)
    check_speed(r)
    m = run(root, "16_compile_mesh.py", nproc=2)
    keep("16_compile_mesh_2gpus", m)
    assert m["fsdp"]["per_block"]["collectives_equal_eager"]
    assert m["tp"]["collectives_equal_eager"]
