"""algbw and busbw, after nccl-tests' PERFORMANCE.md
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

- algorithm bandwidth ``algbw = S / t``: the message size S in bytes over
  the time t of one operation;
- bus bandwidth ``busbw = algbw * factor``, the factor making the number
  comparable to the link's peak whatever the world size n: ``2(n-1)/n``
  for all_reduce, ``(n-1)/n`` for reduce_scatter, all_gather and
  all_to_all, ``1`` for broadcast, reduce and send/recv;
- 1 GB/s = 1e9 bytes per second.

Also the message sizes of a sweep and how to print a size.
"""

from __future__ import annotations

from collections.abc import Callable

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


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
"""The collectives the lesson sweeps, in nccl-tests' order of size conventions."""
