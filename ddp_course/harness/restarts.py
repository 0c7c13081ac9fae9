"""What lets a job restart and a failed job name its first failing rank; called by
:func:`ddp_course.runtime.distributed` under torchrun, so scripts stay the few lines a
training script writes by hand.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

__all__ = ["attempt_prefix", "attempt_store", "report_failure"]


def attempt_store(timeout: datetime.timedelta | None) -> dist.Store | None:
    """This restart attempt's view of torchrun's agent store, or None outside torchrun's
    agent store (``TORCHELASTIC_USE_AGENT_STORE`` unset): a ``PrefixStore`` with
    :func:`attempt_prefix` over a client of ``MASTER_ADDR:MASTER_PORT``.
    """
    # torchrun's agent hosts one store for the workers and keeps it, at the same
    # MASTER_ADDR:MASTER_PORT, across restarts (TORCHELASTIC_USE_AGENT_STORE=True),
    # while env:// assumes a fresh store each attempt and uses no prefix. The
    # restarted ranks then may read the dead ranks' gloo addresses, still in the
    # store, before the new ranks overwrite them, and fail with "Connection
    # refused" or hang (plain torchrun --max-restarts=1: 9 of 15 restarts
    # failed here). A prefix per attempt keeps each attempt's keys apart. The
    # restart count stays the same when the workers restart because a node
    # joined (elastic membership), so the world size is part of the prefix too.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=5),
    )
    return dist.PrefixStore(attempt_prefix(), client)


def attempt_prefix() -> str:
    """The key prefix of this restart attempt in torchrun's agent store.

    ``ddp_course/attempt_<TORCHELASTIC_RESTART_COUNT>_world_<WORLD_SIZE>``:
    the same on every rank of one attempt, different from the attempts before
    it, both after a failure (the count grows) and after a node joined or left
    (the world size changes).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"ddp_course/attempt_{attempt}_world_{os.environ.get('WORLD_SIZE', '1')}"


def report_failure(rank: int, exc: BaseException) -> None:
    """Say on stderr when ``rank`` failed, and record ``exc`` in torchrun's error file.

    When one rank fails, its peers fail soon after ("Connection closed by peer"). A
    time stamp in microseconds lets the launcher name the rank that failed first
    (:func:`ddp_course.harness.failures.failing_rank`); torchrun's own error file
    (what ``@record`` writes) has whole seconds only.
    """
    print(f"[ddp_course] rank {rank} failed at t={time.time():.6f}", file=sys.stderr)
    ErrorHandler().record_exception(exc)
