"""Cost models of communication: the alpha-beta (latency-bandwidth) model, its fit to
measured times, and what it predicts for a ring all-reduce, a parameter server and busbw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .bandwidth import busbw_factor


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
    Arguments, result and error as :func:`ring_all_reduce_time`'s, ``link``
    being the model of a one-way send.
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


def predicted_busbw(
    fit: AlphaBeta, nbytes: float | np.ndarray, collective: str, world_size: int
) -> float | np.ndarray:
    """busbw in bytes/s that the alpha-beta fit predicts at size ``nbytes``.

    ``S / (alpha + beta S) * factor`` (nccl-tests' busbw of the modelled
    time): it grows with S and tends to :func:`busbw_plateau`; it is half
    the plateau at ``S = alpha / beta``.

    Raises:
        ValueError: as :func:`busbw_factor`.
    """
    s = np.asarray(nbytes, dtype=float)
    return s / fit.predict(s) * busbw_factor(collective, world_size)


def busbw_plateau(fit: AlphaBeta, collective: str, world_size: int) -> float:
    """The busbw in bytes/s that large messages approach: ``factor / beta``.

    For S much larger than ``alpha / beta`` the time is ``beta S`` and
    algbw tends to ``1 / beta``; busbw scales it by the collective's factor
    (nccl-tests PERFORMANCE.md).

    Raises:
        ValueError: as :func:`busbw_factor`.
    """
    return fit.bandwidth * busbw_factor(collective, world_size)


def fit_each(
    rows: Iterable[Mapping[str, object]],
    key: str = "collective",
    size: str = "bytes",
    seconds: str = "median_s",
    min_bytes: float = 0,
) -> dict[str, AlphaBeta]:
    """One alpha-beta fit (:func:`fit_alpha_beta`, relative errors) per value of ``key``.

    Args:
        rows: records such as :func:`write_records` stores, each with the
            fields named by ``key``, ``size`` (bytes) and ``seconds``.
        key: the field that names the curve (e.g. the collective).
        size: the field with the message size S in bytes.
        seconds: the field with the time in seconds.
        min_bytes: ignore smaller messages (e.g. below a transport switch).

    Returns:
        ``{curve: AlphaBeta}`` in order of first appearance.

    Raises:
        ValueError: a curve has fewer than two distinct sizes, or a row
            lacks a field.
    """
    points: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        for field in (key, size, seconds):
            if field not in row:
                raise ValueError(f"a row has no field {field!r}: {dict(row)}")
        if float(row[size]) < min_bytes:
            continue
        xs, ts = points.setdefault(str(row[key]), ([], []))
        xs.append(float(row[size]))
        ts.append(float(row[seconds]))
    return {name: fit_alpha_beta(xs, ts) for name, (xs, ts) in points.items()}
