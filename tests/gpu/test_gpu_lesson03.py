"""Lesson 03 on this machine's GPUs: ``03_process_groups.py`` under torchrun with one rank
per GPU (the launcher's plan, nccl) and as one plain process on ``cuda:0``; with 2 GPUs,
``03_collectives.py --deadlock`` on nccl.

The script creates the default group four times, one after another; the fourth names the
backends per device type (``"cpu:gloo,cuda:nccl"``) with ``device_id=`` on a tcp:// store
of its own. On a GPU that is the path CPU runs cannot take (they make the fourth group with
``"cpu:gloo"``). Notebook 03 says nccl's watchdog, not the launcher, ends the deadlock where
every rank receives first; the last test checks it. Skipped, with the reason, on a machine
without a GPU (or with too few); ``python -m ddp_course gpu-check`` runs this file and keeps
the results. Each test takes a few seconds, mostly process start-up.
"""

import pytest
from gpu_support import RANKS, keep, needs_2_gpus, needs_gpu, run

from ddp_course.harness import launch

pytestmark = pytest.mark.serial

METHODS = ["env://", "tcp://", "file://"]
PER_DEVICE = "cpu:gloo,cuda:nccl + device_id"


def check_groups(r: dict, world_size: int) -> None:
    """Four groups, each all-reduced ``rank + 1`` over ``world_size`` GPU ranks with nccl."""
    assert r["device"] == "cuda:0" and r["world_size"] == world_size, r["device"]
    assert r["backend_argument"] is None  # torch's default: the accelerator's backend
    assert list(r["init"]) == [*METHODS, PER_DEVICE], list(r["init"])
    total = world_size * (world_size + 1) // 2
    for method, got in r["init"].items():
        assert got["sum"] == total, (method, got)
        assert "cuda:nccl" in got["backend"], (method, got)  # CUDA tensors went over nccl
    # The fourth group: gloo for CPU tensors beside nccl, on rank 0's own loopback store.
    fourth = r["init"][PER_DEVICE]
    assert fourth["backend"] == "cpu:gloo,cuda:nccl", fourth
    assert fourth["store_listens_on"] == ["127.0.0.1"], fourth


@needs_gpu
def test_process_groups_with_one_rank_per_gpu(root):
    r = run(root, "03_process_groups.py")  # nproc = RANKS, one GPU each
    keep("03_process_groups", r)
    check_groups(r, RANKS)
    assert r["init"]["env://"]["store_listens_on"] == []  # torchrun's agent serves env://


@needs_gpu
def test_process_groups_as_one_plain_process_on_a_gpu(root):
    job = launch.python(
        root / "scripts/03_process_groups.py", results=True, echo=False, timeout_s=300
    )
    keep("03_process_groups_plain", job.results)
    check_groups(job.results, 1)
    assert job.results["init"]["env://"]["store_listens_on"] == ["127.0.0.1"]  # its own


@needs_2_gpus
def test_recv_first_deadlock_ends_in_the_nccl_watchdogs_timeout(root):
    args = ["--deadlock", "--timeout-s", "3"]  # notebook 03's settings
    with pytest.raises(launch.LaunchError) as caught:
        launch.torchrun(root / "scripts/03_collectives.py", args, nproc=2, timeout_s=90, echo=False)
    assert not isinstance(caught.value, launch.LaunchTimeout)  # the process group ended it
    lines = [
        line
        for text in caught.value.logs.values()
        for line in text.splitlines()
        if launch.is_timeout(line)
    ]
    assert any("collective operation timeout" in line for line in lines), lines
