"""Byte accounting of the hand-written all-reduce algorithms (notebook 04).

How many bytes each rank sends and receives, and in how many rounds, when
``ddp_course.collectives`` all-reduces a tensor of K bytes over N ranks:

- ring (reduce-scatter then all-gather): every rank sends and receives
  2(N-1)/N * K bytes in 2(N-1) steps, below 2K for any N (Patarasuk and
  Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009; Gibiansky, "Bringing HPC techniques to deep
  learning", Baidu Research 2017);
- parameter server: the server sends and receives (N-1) * K bytes, each
  worker K, in 2 steps.

The algorithms count what they actually pass to ``isend``/``irecv`` into a
:class:`CommStats`; the functions here give what the formulas expect, so a
test can compare the two. Which bytes each rank owns is
:func:`ddp_course.partition.partition`'s ``"split"`` style.

What code that calls ``torch.distributed`` (or DDP, FSDP2, DTensor) sends is
logged by :class:`ddp_course.tools.collective_log.CollectiveLog`.

Which link a timed sweep measured (one device plan for every world size, and
its label) is :mod:`ddp_course.tools.bench.links`.
"""

from __future__ import annotations

import dataclasses

from .partition import check_rank, partition

__all__ = [
    "CommStats",
    "parameter_server_bytes",
    "ring_bytes",
]


@dataclasses.dataclass
class CommStats:
    """What one rank moved in one or more hand-written collectives.

    Attributes:
        bytes_sent: payload bytes this rank sent (``numel * element_size``
            of everything it passed to ``isend``).
        bytes_received: payload bytes this rank received.
        steps: communication rounds this rank waited for; each costs at
            least one latency (alpha) in the alpha-beta model.

    Stats add up: ``total = reduce_scatter_stats + all_gather_stats``.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(
            self.bytes_sent + other.bytes_sent,
            self.bytes_received + other.bytes_received,
            self.steps + other.steps,
        )

    @property
    def bytes_total(self) -> int:
        """Bytes sent plus bytes received."""
        return self.bytes_sent + self.bytes_received


def ring_bytes(numel: int, element_size: int, world_size: int, rank: int) -> CommStats:
    """The traffic :func:`ddp_course.collectives.ring_all_reduce` causes at ``rank``, in bytes.

    In the reduce-scatter rank r sends every chunk but its own (chunk r) and
    receives every chunk but chunk r-1; in the all-gather it sends every
    chunk but chunk r+1 and receives every chunk but its own. So it sends
    ``2K - |chunk r| - |chunk r+1|`` bytes and receives
    ``2K - |chunk r-1| - |chunk r|``. When ``numel`` is a multiple of N both
    are exactly ``2(N-1)/N * K`` (the bandwidth-optimal bound, Patarasuk and
    Yuan 2009); otherwise they differ from it by less than two elements and
    their mean over ranks is still ``2(N-1)/N * K``.

    Args:
        numel: elements of the tensor; ``K = numel * element_size`` bytes.
        element_size: bytes per element (``tensor.element_size()``), >= 1.
        world_size: N >= 1.
        rank: 0 <= rank < N.

    Returns:
        The expected :class:`CommStats`, with 2(N-1) steps.

    Raises:
        ValueError: on an out-of-range rank or a bad size.
    """
    check_rank(rank, world_size)
    _check_size(numel, element_size)
    if world_size == 1:
        return CommStats()
    sizes = [stop - start for start, stop in partition(numel, world_size)]
    sent = 2 * numel - sizes[rank] - sizes[(rank + 1) % world_size]
    received = 2 * numel - sizes[rank - 1] - sizes[rank]
    return CommStats(sent * element_size, received * element_size, 2 * (world_size - 1))


def parameter_server_bytes(
    numel: int, element_size: int, world_size: int, rank: int, root: int = 0
) -> CommStats:
    """Bytes :func:`ddp_course.collectives.parameter_server_all_reduce` moves at ``rank``.

    The server (``root``) receives K bytes from each of the N-1 workers and
    sends K back to each: (N-1)K each way, 2(N-1)K in all. A worker sends K
    and receives K, whatever N is. Both take 2 steps (gather, then send back).

    Args:
        numel: elements of the tensor; ``K = numel * element_size`` bytes.
        element_size: bytes per element, >= 1.
        world_size: N >= 1.
        rank: 0 <= rank < N.
        root: the server's rank, 0 <= root < N.

    Returns:
        The expected :class:`CommStats`.

    Raises:
        ValueError: on an out-of-range rank or root, or a bad size.
    """
    check_rank(rank, world_size)
    check_rank(root, world_size, "root")
    _check_size(numel, element_size)
    if world_size == 1:
        return CommStats()
    nbytes = numel * element_size * (world_size - 1 if rank == root else 1)
    return CommStats(nbytes, nbytes, 2)


def _check_size(numel: int, element_size: int) -> None:
    if numel < 0 or element_size < 1:
        raise ValueError(f"need numel >= 0 and element_size >= 1, not {numel}, {element_size}")
