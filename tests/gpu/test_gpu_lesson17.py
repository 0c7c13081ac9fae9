"""Lesson 17 on this machine's GPUs: ``17_diloco.py`` as plain ``python`` (a group of one:
nccl on ``cuda:0``) and, with 2 GPUs or more, the notebook's 2-rank job with nccl: DiLoCo
at H=1 equal to DDP, the ranks equal after each synchronisation, H times fewer bytes; and
``17_async_checkpoint.py``'s time part on one GPU. The replica groups of
``17_replicas.py`` always run on the CPU (``replica_groups.REPLICA_GROUPS_REASON``).

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


@needs_gpu
def test_async_checkpoint_of_a_gpu_state(root, tmp_path):
    """17_async_checkpoint.py's time part on cuda:0: async_save stages the GPU state to CPU
    memory before it returns, so the checkpoint holds the state at the call; the seconds
    each kind of save blocks are kept for the record (not asserted: shared machines)."""
    r = run_plain(root, "17_async_checkpoint.py", ["--folder", str(tmp_path), "--repeats", "2"])
    keep("17_async_checkpoint_plain", r)
    assert r["device"].startswith("cuda"), r["device"]
    saves = r["time"]
    n = saves["tensors"]
    assert saves["during"]["equal_to_state_at_call"] == [n]
    assert saves["during"]["equal_to_state_after_update"] == [0]
    for name, loaded in saves["loaded_equal"].items():
        assert loaded["after"] == [n], name
