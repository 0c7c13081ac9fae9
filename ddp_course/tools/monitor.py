"""Per-rank training metrics: recorded quietly, gathered on rank 0, written to JSON and
TensorBoard, and searched for stragglers.

Every rank keeps its own rows (one per step: seconds per section, samples/s,
loss, memory) in memory and prints nothing; :func:`gather_metrics` brings all
ranks' rows to rank 0, which writes them once (:func:`write_json`,
:func:`write_tensorboard`). In synchronous data parallelism a slow rank makes
every rank's *step* equally slow, because the others wait for it inside the
all-reduce; what tells the straggler apart is the time a rank spends on its
own work before the collective (:func:`find_stragglers`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ..runtime import DistContext

__all__ = [
    "RankMetrics",
    "find_stragglers",
    "gather_metrics",
    "memory_bytes",
    "read_tensorboard",
    "write_json",
    "write_tensorboard",
]


def memory_bytes(device: torch.device) -> int:
    """Memory this rank holds, in bytes: the CUDA allocator's peak on a GPU, the
    process's resident set size (RSS, from psutil) on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(psutil.Process(os.getpid()).memory_info().rss)


class RankMetrics:
    """One rank's metrics, one row (a dict of numbers) per step, kept in memory.

    Usage::

        metrics = RankMetrics(ctx.rank, ctx.device)
        with metrics.step(step, samples=len(x)) as row:
            with metrics.timed(row, "local_s"):
                ...  # data and forward: this rank's own work
            with metrics.timed(row, "sync_s"):
                ...  # backward with DDP's all-reduce: waits for the slowest rank
            row["loss"] = loss.item()

    Each row holds ``step``, ``samples``, the timed sections in seconds,
    ``step_time_s`` (seconds), ``samples_per_s`` and ``memory_bytes``.
    """

    def __init__(self, rank: int, device: torch.device | str = "cpu"):
        self.rank = rank
        self.device = torch.device(device)
        self.rows: list[dict[str, float]] = []

    @contextlib.contextmanager
    def step(self, step: int, samples: int) -> Iterator[dict[str, float]]:
        """Time one step; the yielded row may be given more values (``loss``)."""
        if samples < 0:
            raise ValueError(f"samples must be >= 0, not {samples}")
        row: dict[str, float] = {"step": step, "samples": samples}
        start = time.perf_counter()
        yield row
        row["step_time_s"] = time.perf_counter() - start
        row["samples_per_s"] = samples / row["step_time_s"] if row["step_time_s"] > 0 else 0.0
        row["memory_bytes"] = memory_bytes(self.device)
        self.rows.append(row)

    @contextlib.contextmanager
    def timed(self, row: dict[str, float], name: str) -> Iterator[None]:
        """Add the seconds the body takes to ``row[name]``. On a GPU, queued kernels are
        waited for first, so the section's time is its work, not its launch."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        row[name] = row.get(name, 0.0) + time.perf_counter() - start


def gather_metrics(metrics: RankMetrics, ctx: DistContext) -> list[list[dict]] | None:
    """Every rank's rows, on rank 0: ``result[rank]`` is that rank's list of rows.

    A collective (``dist.gather_object``): every rank must call it. Returns
    ``None`` on the other ranks; a single process gets ``[metrics.rows]``.
    """
    if not ctx.is_distributed:
        return [list(metrics.rows)]
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(list(metrics.rows), gathered, dst=0)
    return gathered


def write_json(path: str | os.PathLike, per_rank: Sequence[Sequence[Mapping]]) -> pathlib.Path:
    """Write ``{"ranks": [[row, ...], ...]}`` as JSON (call on rank 0); returns the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ranks": [list(rows) for rows in per_rank]}, indent=1) + "\n")
    return out


def write_tensorboard(logdir: str | os.PathLike, per_rank: Sequence[Sequence[Mapping]]) -> None:
    """Write every numeric value of every row as a TensorBoard scalar (call on rank 0).

    The tag is ``<metric>/rank_<r>`` and the x axis the row's ``step``, so
    TensorBoard shows one chart per metric with a line per rank
    (``tensorboard --logdir LOGDIR``). Uses ``torch.utils.tensorboard``, which
    needs the ``tensorboard`` package.
    """
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for rank, rows in enumerate(per_rank):
            for row in rows:
                for key, value in row.items():
                    if key != "step" and isinstance(value, (int, float)):
                        writer.add_scalar(f"{key}/rank_{rank}", value, int(row["step"]))
    finally:
        writer.close()


def read_tensorboard(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir``: ``{tag: [(step, value), ...]}``.

    Read with TensorBoard's own ``EventAccumulator``, keeping every point.

    Raises:
        FileNotFoundError: if ``logdir`` holds no event file.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not list(pathlib.Path(logdir).glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard event file in {logdir}")
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def find_stragglers(
    local_s: Sequence[Sequence[float]], factor: float = 2.0, min_excess_s: float = 0.005
) -> list[int]:
    """Ranks whose own work (seconds before the collective, per step) is much slower.

    For each rank, the median of its per-step times is compared with the
    median of the other ranks' medians; the rank is a straggler when it is
    more than ``factor`` times that and at least ``min_excess_s`` seconds
    more (a millisecond step that jitters by 2x is noise, not a straggler).
    Medians, so one slow step (a page fault, another job) does not count.

    Args:
        local_s: ``local_s[rank]`` is that rank's per-step seconds of local
            work (data, forward; not time spent waiting in a collective).
        factor: how many times slower than the others, > 1.
        min_excess_s: seconds a straggler's median must exceed the others' by.

    Returns:
        The straggling ranks, ascending; ``[]`` when the ranks are even.

    Raises:
        ValueError: fewer than 2 ranks, a rank without steps, ``factor <= 1``
            or ``min_excess_s < 0``.
    """
    if len(local_s) < 2:
        raise ValueError(f"need the times of at least 2 ranks, got {len(local_s)}")
    if any(len(times) == 0 for times in local_s):
        raise ValueError("every rank needs at least one step time")
    if factor <= 1 or min_excess_s < 0:
        raise ValueError(f"need factor > 1 and min_excess_s >= 0, got {factor}, {min_excess_s}")
    medians = [statistics.median(times) for times in local_s]
    slow = []
    for rank, median in enumerate(medians):
        others = statistics.median(medians[:rank] + medians[rank + 1 :])
        if median > factor * others and median - others >= min_excess_s:
            slow.append(rank)
    return slow
