"""Lesson 04's script under torchrun and as one process: the sweep's shape, the bytes the
ring sends against 2(N-1)/N K, algbw and busbw from the medians (the device plan of the sweep:
test_lesson04_devices.py)."""

import pytest

from ddp_course import runtime
from ddp_course.harness import launch
from ddp_course.tools.bench import busbw_factor


def test_script_04_tiny_sweep_under_torchrun(root):
    args = ["--max-bytes", "16384", "--warmup", "0", "--repeats", "2"]
    job = launch.torchrun(
        root / "scripts/04_allreduce.py", args, nproc=2, results=True, echo=False, timeout_s=180
    )
    r = job.results
    backend = runtime.device_plan(2, runtime.gpu_count()).backend  # nccl with 2 GPUs
    assert (r["world_size"], r["backend"], r["sizes"]) == (2, backend, [4096, 8192, 16384])
    k = 12_000 * 4
    assert r["checks"]["ring"] == [[k, k, 2], [k, k, 2]]  # 2(N-1)/N K = K each way at N = 2
    for name, collective in (
        ("torch", "all_reduce"),
        ("ring", "all_reduce"),
        ("send", "sendrecv"),
        ("exchange", "sendrecv"),
    ):
        row = r["sweep"][name]
        assert len(row["times_s"]) == 3 and all(len(ts) == 2 for ts in row["times_s"])
        for size, t, alg, bus in zip(
            r["sizes"], row["median_s"], row["algbw_GBps"], row["busbw_GBps"], strict=True
        ):
            assert alg == pytest.approx(size / t / 1e9)
            assert bus == pytest.approx(alg * busbw_factor(collective, 2))
    # The busiest rank's rate: at N = 2 ring and server both send S bytes from every rank;
    # the backend's own algorithm is not counted.
    for name in ("ring", "ps", "send"):
        row = r["sweep"][name]
        for size, t, rate in zip(r["sizes"], row["median_s"], row["busiest_GBps"], strict=True):
            assert rate == pytest.approx(size / t / 1e9)
    assert r["sweep"]["torch"]["busiest_GBps"] == [None] * 3
    assert set(r["fits"]) == {"torch", "ring", "ps", "send", "exchange"}
    assert len(r["ring_over_torch_algbw"]) == 3


def test_script_04_as_one_process_checks_but_does_not_sweep(root):
    job = launch.python(root / "scripts/04_allreduce.py", results=True, echo=False)
    assert job.results["world_size"] == 1 and "sweep" not in job.results
    assert job.results["checks"]["ring"] == [[0, 0, 0]]
