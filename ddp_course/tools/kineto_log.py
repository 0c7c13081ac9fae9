"""Kineto's start and stop lines, kept out of a profiled cell's output.

A CUDA build of PyTorch profiles through Kineto (https://github.com/pytorch/kineto),
whose C++ logger writes to file descriptor 2 each time a profiler starts and stops::

    USDT:2026-11-27 04:37:24 15490:15490 SyncActivityProfilerHandler.cpp:52] profiler_start
    USDT:2026-11-27 04:37:24 15490:15490 SyncActivityProfilerHandler.cpp:59] profiler_stop

and, once per process on a machine without a GPU (CUDA error 35: no driver)::

    ERROR:... DeviceProperties.cpp:50] gpuGetDeviceCount failed with code 35

Python's ``sys.stderr`` never sees them, so ``contextlib.redirect_stderr`` cannot
hide them, and ``KINETO_LOG_LEVEL`` removes the ERROR line only. :func:`quiet_kineto`
points file descriptor 2 at a temporary file while the profiler runs, then writes
back to descriptor 2 every line that is not one of these three (:data:`BANNERS`):
anything else native code printed meanwhile still shows, only later.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["BANNERS", "quiet_kineto"]

#: Kineto's start and stop lines, and its "no GPU" line (level, date, time, pid:tid, source).
BANNERS = re.compile(
    r"(USDT|ERROR):\S+ \S+ \d+:\d+ "
    r"(SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"
    r"|DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code 35)\s*"
)


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Hold what native code writes to file descriptor 2 inside the block; afterwards
    write back every line but Kineto's (:data:`BANNERS`), in order.

    Python's ``sys.stderr`` is flushed on entry and exit, so its lines keep their
    place when it writes to descriptor 2 (a plain process); in Jupyter it does not,
    and is unaffected. Not for a block that may kill the process: the held lines
    would be lost with it.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not BANNERS.fullmatch(line))
            if kept:
                os.write(2, kept.encode())
