"""Measuring communication: timing, algbw/busbw, the alpha-beta model, scaling.

Definitions follow nccl-tests' PERFORMANCE.md
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

- algorithm bandwidth ``algbw = S / t``: the message size S in bytes over
  the time t of one operation;
- bus bandwidth ``busbw = algbw * factor``, the factor making the number
  comparable to the link's peak whatever the world size n: ``2(n-1)/n``
  for all_reduce, ``(n-1)/n`` for reduce_scatter, all_gather and
  all_to_all, ``1`` for broadcast, reduce and send/recv;
- 1 GB/s = 1e9 bytes per second.

Timing differs from nccl-tests on one point, for a noisy shared CPU: each
timed iteration starts at a barrier, its time is the slowest rank's
(``all_reduce(MAX)`` over ranks) and the reported time is the median over
iterations after warm-up, with the interquartile range as the spread
(nccl-tests reports the mean over iterations).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .runtime import DistContext, barrier

__all__ = [
    "BUSBW_FACTORS",
    "AlphaBeta",
    "Timing",
    "algbw",
    "busbw",
    "busbw_factor",
    "fit_alpha_beta",
    "format_bytes",
    "message_sizes",
    "parameter_server_time",
    "ring_all_reduce_time",
    "scaling_efficiency",
    "summarize",
    "time_op",
]

GB = 1e9
"""Bytes in a GB, as nccl-tests counts them."""

BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
"""busbw / algbw for each collective at world size n (nccl-tests PERFORMANCE.md)."""


def busbw_factor(collective: str, world_size: int) -> float:
    """The factor busbw / algbw of ``collective`` with ``world_size`` ranks.

    From nccl-tests PERFORMANCE.md: an all_reduce of S bytes makes every
    rank send and receive 2(n-1)/n * S bytes, so ``busbw = algbw * 2(n-1)/n``
    is the bandwidth each link actually carried.

    Raises:
        ValueError: unknown collective (see :data:`BUSBW_FACTORS`) or
            ``world_size < 1``.
    """
    if collective not in BUSBW_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; one of {sorted(BUSBW_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    return BUSBW_FACTORS[collective](world_size)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth ``S / t`` in bytes per second (nccl-tests PERFORMANCE.md).

    Raises:
        ValueError: if ``seconds <= 0`` or ``nbytes < 0``.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, not {seconds}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, not {nbytes}")
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, collective: str, world_size: int) -> float:
    """Bus bandwidth in bytes per second: ``algbw * busbw_factor`` (nccl-tests).

    Raises:
        ValueError: as :func:`algbw` and :func:`busbw_factor`.
    """
    return algbw(nbytes, seconds) * busbw_factor(collective, world_size)


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


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """The alpha-beta (latency-bandwidth) model ``t(S) = alpha + beta * S``.

    Attributes:
        alpha: latency in seconds, the time of an empty message.
        beta: seconds per byte, ``1 / bandwidth``.
    """

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """``1 / beta`` in bytes per second (``inf`` when beta is 0)."""
        return float("inf") if self.beta == 0 else 1.0 / self.beta

    @property
    def half_bandwidth_bytes(self) -> float:
        """The size ``alpha / beta`` at which half the bandwidth is reached, in bytes."""
        return float("inf") if self.beta == 0 else self.alpha / self.beta

    def predict(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """``alpha + beta * nbytes`` in seconds."""
        return self.alpha + self.beta * np.asarray(nbytes, dtype=float)


def fit_alpha_beta(
    nbytes: Sequence[float], seconds: Sequence[float], relative: bool = True
) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + beta * S`` to measured times.

    With ``relative=True`` (default) each point is weighted by ``1/t``, so
    the fit minimises relative errors: sizes spanning four decades then
    all count, instead of the largest ones alone deciding alpha.

    Args:
        nbytes: message sizes S in bytes, at least two distinct.
        seconds: measured times t in seconds (> 0), same length.
        relative: weight by ``1/t`` (else ordinary least squares).

    Returns:
        :class:`AlphaBeta`; alpha may come out negative when latency is
        below the noise.

    Raises:
        ValueError: different lengths, fewer than two distinct sizes, or a
            non-positive time.
    """
    s = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"need two 1-D sequences of one length, got {s.shape} and {t.shape}")
    if len(np.unique(s)) < 2:
        raise ValueError("need at least two distinct message sizes to fit alpha and beta")
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    w = 1.0 / t if relative else np.ones_like(t)
    a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    return AlphaBeta(float(alpha), float(beta))


def ring_all_reduce_time(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    """Predicted ring all-reduce time: ``2(N-1) * alpha + 2(N-1)/N * S * beta`` seconds.

    2(N-1) steps (reduce-scatter then all-gather), each moving one chunk of
    S/N bytes over every link at once (Patarasuk and Yuan 2009; Gibiansky
    2017). The model assumes every rank has a full-duplex link of its own;
    where all ranks share one machine's cores, time follows the total
    bytes instead.

    Args:
        nbytes: message size S in bytes.
        world_size: N ranks, >= 1.
        link: the point-to-point model of one step's exchange (seconds, s/byte).

    Returns:
        Seconds; 0 for one rank.

    Raises:
        ValueError: if ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    steps = 2 * (world_size - 1)
    return steps * link.alpha + steps / world_size * nbytes * link.beta


def parameter_server_time(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    """Predicted parameter-server time: ``2 * alpha + 2(N-1) * S * beta`` seconds.

    The server's link carries the N-1 workers' tensors in, then the result
    out to each, 2(N-1)S bytes one after the other: the bottleneck that
    grows with N (the byte counts are ``comm_cost.parameter_server_bytes``).

    Args:
        nbytes: message size S in bytes.
        world_size: N ranks, >= 1.
        link: the point-to-point model of a one-way send (seconds, s/byte).

    Returns:
        Seconds; 0 for one rank.

    Raises:
        ValueError: if ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if world_size == 1:
        return 0.0
    return 2 * link.alpha + 2 * (world_size - 1) * nbytes * link.beta


def scaling_efficiency(
    value_1: float, value_n: float, world_size: int, kind: str = "weak"
) -> float:
    """Parallel efficiency, 1.0 meaning perfect scaling.

    - ``kind="weak"``: values are throughputs (e.g. samples/s) with a fixed
      amount of work per rank: ``thr(N) / (N * thr(1))``.
    - ``kind="strong"``: values are times for a fixed total amount of work:
      ``t(1) / (N * t(N))``, the speed-up ``t(1)/t(N)`` divided by N.

    Raises:
        ValueError: unknown kind, non-positive values or ``world_size < 1``.
    """
    if kind not in ("weak", "strong"):
        raise ValueError(f"kind must be 'weak' or 'strong', not {kind!r}")
    if value_1 <= 0 or value_n <= 0:
        raise ValueError("values must be positive")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if kind == "weak":
        return value_n / (world_size * value_1)
    return value_1 / (world_size * value_n)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Sizes ``min_bytes * factor**k`` up to ``max_bytes``, in bytes (like ``-b -e -f``).

    Raises:
        ValueError: if ``min_bytes < 1``, ``max_bytes < min_bytes`` or ``factor < 2``.
    """
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad sweep {min_bytes}..{max_bytes} by {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def format_bytes(nbytes: float) -> str:
    """``4096 -> '4 KiB'``, ``16 * 2**20 -> '16 MiB'`` (binary prefixes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"
