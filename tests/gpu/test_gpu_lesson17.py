"""Lesson 17 on this machine's GPUs: ``17_diloco.py`` as plain ``python`` (a group of one:
nccl on ``cuda:0``) and, with 2 GPUs or more, the notebook's 2-rank job with nccl: DiLoCo
at H=1 equal to DDP, the ranks equal after each synchronisation, H times fewer bytes.

Skipped, with the reason, on a machine without a GPU (or with too few); ``python -m
ddp_course gpu-check`` runs this file and keeps the results.
"""

import pytest
from gpu_support import keep, needs_2_gpus, needs_gpu, run, run_plain

pytestmark = pytest.mark.serial

ARGS = ["--part", "check", "train", "--steps", "20", "--sync-every", "5", "10"]
ARGS += ["--eval-every", "10"]


def check(r: dict) -> None:
    """What notebook 17 asserts of the job, on CUDA with nccl."""
    assert r["device"].startswith("cuda") and r["meta"]["backend"] == "nccl", r["meta"]
    assert max(r["check"]["h1_vs_ddp_per_step"]) <= 1e-12
    synced = [s["rank_spread"] == 0.0 for s in r["check"]["h2_spread"]]
    assert synced == [s["synced"] or r["world_size"] == 1 for s in r["check"]["h2_spread"]]
    methods = r["methods"]
    one = methods["ddp"]["param_bytes"]
    for h in (5, 10):
        assert methods[f"diloco H={h}"]["bytes"] == 20 // h * one


@needs_gpu
def test_diloco_as_plain_python_on_a_gpu(root):
    r = run_plain(root, "17_diloco.py", ARGS)
    keep("17_diloco_plain", r)
    check(r)


@needs_2_gpus
def test_the_notebooks_job_with_nccl(root):
    r = run(root, "17_diloco.py", ARGS, nproc=2)
    keep("17_diloco_2gpus", r)
    check(r)
