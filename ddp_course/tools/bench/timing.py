"""Timing an operation of every rank at once, on a noisy shared machine.

Timing differs from nccl-tests on one point: each timed iteration starts at a
barrier, its time is the slowest rank's (``all_reduce(MAX)`` over ranks) and the
reported time is the median over iterations after warm-up, with the interquartile
range as the spread (nccl-tests reports the mean over iterations).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ...runtime import DistContext, barrier


@dataclasses.dataclass(frozen=True)
class Timing:
    """Summary of repeated timings, in seconds.

    Attributes:
        median: the median time.
        q1, q3: first and third quartiles (the interquartile range is the spread).
        min: the fastest repeat.
        repeats: how many timings.
    """

    median: float
    q1: float
    q3: float
    min: float
    repeats: int

    @property
    def iqr(self) -> float:
        """Interquartile range ``q3 - q1`` in seconds."""
        return self.q3 - self.q1


def summarize(times: Sequence[float]) -> Timing:
    """Median, quartiles and minimum of ``times`` (seconds).

    Raises:
        ValueError: if ``times`` is empty.
    """
    if len(times) == 0:
        raise ValueError("no timings to summarize")
    values = sorted(float(t) for t in times)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Timing(statistics.median(values), q1, q3, values[0], len(values))


def _sync(ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def time_op(
    fn: Callable[[], object], ctx: DistContext, warmup: int = 2, repeats: int = 10
) -> list[float]:
    """Time ``fn()`` ``repeats`` times after ``warmup`` calls; slowest rank per repeat.

    Each repeat starts at a barrier, so all ranks start together, and ends
    when this rank's ``fn`` returned (and, on CUDA, the device finished).
    The per-rank times are then combined with one ``all_reduce(MAX)``, so a
    repeat counts as long as its slowest rank took: a collective is only
    done when every rank is. All ranks must call this together.

    Args:
        fn: the operation; a collective every rank calls.
        ctx: this process's context (``runtime.distributed()``).
        warmup: untimed calls first (connections, allocations, caches), >= 0.
        repeats: timed calls, >= 1.

    Returns:
        ``repeats`` times in seconds, the same list on every rank.

    Raises:
        ValueError: if ``warmup < 0`` or ``repeats < 1``.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, not {warmup} and {repeats}")
    for _ in range(warmup):
        fn()
    _sync(ctx)
    times = []
    for _ in range(repeats):
        barrier(ctx)
        start = time.perf_counter()
        fn()
        _sync(ctx)
        times.append(time.perf_counter() - start)
    t = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    if ctx.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_interleaved(
    settings: Mapping[str, Callable[[], object]],
    ctx: DistContext,
    warmup: int = 2,
    repeats: int = 10,
    active: Callable[[str], bool] | None = None,
    progress: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Time every setting once per repeat, rotating the order; slowest rank per call.

    :func:`time_op` for several settings at once: repeat r runs them in the
    order ``names[r:] + names[:r]``, so a slow spell of the machine falls on
    all of them alike instead of on whichever ran then. Each call starts at a
    barrier and counts as long as its slowest rank took (one
    ``all_reduce(MAX)`` per call). All ranks must call this together.

    Args:
        settings: name -> the operation, a function of no arguments.
        ctx: this process's context.
        warmup: untimed calls of each setting first, >= 0.
        repeats: timed calls of each setting, >= 1.
        active: ``active(name)`` says whether this rank takes part in that
            setting (runs on a sub-group); the others wait. Default: all do.
        progress: called after every timed call (e.g. a progress bar's ``update``).

    Returns:
        ``{name: [seconds per repeat]}``, the same on every rank.

    Raises:
        ValueError: if ``warmup < 0`` or ``repeats < 1``.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, not {warmup} and {repeats}")
    names = list(settings)
    active = active or (lambda name: True)
    for name in names:
        for _ in range(warmup):
            if active(name):
                settings[name]()
        barrier(ctx)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            barrier(ctx)
            start = time.perf_counter()
            if active(name):
                settings[name]()
                _sync(ctx)
            elapsed = torch.tensor(
                [time.perf_counter() - start], dtype=torch.float64, device=ctx.device
            )
            if ctx.is_distributed:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
            if progress is not None:
                progress()
    return times


def slowest_rank(times_by_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per iteration, the time of the slowest rank, in seconds.

    A collective is finished only when every rank has finished it, so an
    iteration lasts as long as its slowest rank (what :func:`time_op` gets
    with one ``all_reduce(MAX)``). Taking the median of one rank's own
    times instead would hide a straggler.

    Args:
        times_by_rank: ``[world_size][iterations]`` seconds, e.g. gathered
            from every rank.

    Returns:
        ``iterations`` seconds, the maximum over ranks of each iteration.

    Raises:
        ValueError: no ranks, or ranks with different numbers of iterations.
    """
    if len(times_by_rank) == 0:
        raise ValueError("no ranks' timings given")
    lengths = {len(t) for t in times_by_rank}
    if len(lengths) != 1:
        raise ValueError(f"every rank must time the same iterations, got lengths {sorted(lengths)}")
    return [max(column) for column in zip(*times_by_rank, strict=True)]


def runnable_tasks(seconds: float = 1.0, samples: int = 20) -> float | None:
    """How many other tasks were ready to run, on average over the next ``seconds``.

    How busy the machine is right now, before a measurement: on Linux the
    fourth field of ``/proc/loadavg`` ("running/total") counts the tasks
    (threads) running or ready to run at that instant, the reading process
    included; this is the mean of ``samples`` readings, less that one.
    Elsewhere the one-minute load average, which lags by about a minute.

    Args:
        seconds: how long to sample, >= 0.
        samples: readings, >= 1.

    Returns:
        Tasks (a mean, >= 0), or None where the system reports neither.

    Raises:
        ValueError: ``seconds < 0`` or ``samples < 1``.
    """
    if seconds < 0 or samples < 1:
        raise ValueError(f"need seconds >= 0 and samples >= 1, not {seconds} and {samples}")
    proc = pathlib.Path("/proc/loadavg")
    if not proc.exists():
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    counts = []
    for i in range(samples):
        if i:
            time.sleep(seconds / samples)
        counts.append(int(proc.read_text().split()[3].split("/")[0]) - 1)
    return max(0.0, sum(counts) / len(counts))
