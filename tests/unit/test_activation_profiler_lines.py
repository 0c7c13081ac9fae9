"""tools.kineto_log.quiet_kineto: Kineto's start, stop and "no GPU" lines, written by C++ to
file descriptor 2 while lesson 14 profiles a step on a CPU (tools.peak_memory), are held
back; every other line native code or Python writes there comes through."""

import os
import sys

import torch

from ddp_course.tools.kineto_log import quiet_kineto
from ddp_course.tools.peak_memory import profiled_peak_bytes

BANNERS = [
    "USDT:2026-11-27 04:37:24 15490:15490 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
    "USDT:2026-11-27 04:37:24 15490:15490 SyncActivityProfilerHandler.cpp:59] profiler_stop\n",
    "ERROR:2026-11-27 04:37:24 15490:15490 DeviceProperties.cpp:50] gpuGetDeviceCount failed "
    "with code 35\n",
]


def test_banners_are_held_back_and_other_lines_come_through(capfd):
    with quiet_kineto():
        os.write(2, "".join(BANNERS[:1] + ["a native line\n"] + BANNERS[1:]).encode())
        print("a python line", file=sys.stderr)
        os.write(2, b"ERROR:2026-11-27 04:37:24 1:1 Other.cpp:1] something else\n")
    # Under pytest sys.stderr is not descriptor 2, so the Python line may come first.
    err = capfd.readouterr().err.splitlines()
    other = "ERROR:2026-11-27 04:37:24 1:1 Other.cpp:1] something else"
    assert sorted(err) == sorted(["a native line", "a python line", other])


def test_profiling_a_step_prints_nothing_to_stderr(capfd):
    a = torch.randn(64, 64)
    assert profiled_peak_bytes(lambda: a @ a) == 64 * 64 * 4
    assert "profiler_start" not in capfd.readouterr().err
