"""What ring attention computes and sends, rank by rank (notebook 15).

The accounting of ring attention (:mod:`.ring`): the work each rank
computes, counted by walking :func:`~.schedule.ring_attention_schedule`
(the schedule the forward and backward run, so no formula), what an uneven
split costs (:func:`load_balance`), the bytes each rank sends
(:func:`ring_attention_bytes` forward, :func:`ring_backward_bytes` backward) and saves
for backward (:func:`ring_saved_bytes`), and, in the alpha-beta model, how long
the ring and Ulysses communicate (:func:`ring_comm_time`,
:func:`ulysses_comm_time`) and where one overtakes the other
(:func:`ring_ulysses_crossover`).
"""

from __future__ import annotations

import math

import torch

from .schedule import ring_attention_schedule

__all__ = [
    "load_balance",
    "ring_backward_bytes",
    "ring_attention_bytes",
    "ring_comm_time",
    "ring_saved_bytes",
    "ring_step_work",
    "ring_ulysses_crossover",
    "ring_work",
    "ulysses_comm_time",
]


def ring_work(
    world_size: int,
    t_local: int,
    layout: str = "contiguous",
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
) -> list[dict[str, int]]:
    """Work per rank, counted by walking :func:`ring_attention_schedule` (no formula).

    Returns:
        One dict per rank: ``blocks`` (products computed), ``pairs`` (query-key
        scores computed, the blocks' sizes) and ``visible`` (scores the mask keeps).
    """
    work = []
    for rank in range(world_size):
        tiles = list(
            ring_attention_schedule(rank, world_size, t_local, layout, causal, document_ids)
        )
        work.append(
            {
                "blocks": len(tiles),
                "pairs": sum(_pairs(t) for t in tiles),
                "visible": sum(_visible(t) for t in tiles),
            }
        )
    return work


def _pairs(tile) -> int:
    return (tile.q.stop - tile.q.start) * (tile.kv.stop - tile.kv.start)


def _visible(tile) -> int:
    return _pairs(tile) if tile.mask is None else int(tile.mask.sum())


def ring_step_work(world_size: int, t_local: int, *args, **kwargs) -> list[list[int]]:
    """Visible query-key pairs per rank and ring step, ``[rank][step]``.

    Walks :func:`ring_attention_schedule` as :func:`ring_work` does; ``args``
    and ``kwargs`` (``layout``, ``causal``, ``document_ids``) as there.
    """
    grid = [[0] * world_size for _ in range(world_size)]
    for rank in range(world_size):
        for tile in ring_attention_schedule(rank, world_size, t_local, *args, **kwargs):
            grid[rank][tile.step] += _visible(tile)
    return grid


def load_balance(step_work: list[list[int]]) -> dict[str, float]:
    """What uneven work costs a ring, from ``step_work[rank][step]`` (:func:`ring_step_work`).

    Returns:
        ``busiest_over_idlest``: how uneven the ranks' totals are (``inf`` if a
        rank has none). ``busiest_over_mean``: the busiest rank's total over the
        mean, the time the job takes against a perfectly balanced split of the
        same work when every rank computes at one speed (the ring finishes with
        its busiest rank). ``lockstep_over_mean``: the sum over steps of the
        busiest rank at that step, over the mean: the time if every step waited
        for all ranks (a barrier per step), at least ``busiest_over_mean``.
    """
    totals = [sum(row) for row in step_work]
    mean = sum(totals) / len(totals)
    lockstep = sum(max(col) for col in zip(*step_work))
    return {
        "busiest_over_idlest": max(totals) / min(totals) if min(totals) else math.inf,
        "busiest_over_mean": max(totals) / mean,
        "lockstep_over_mean": lockstep / mean,
    }


def ring_attention_bytes(shape: tuple[int, ...], element_size: int, world_size: int) -> int:
    """Bytes one rank sends in ring attention's forward: 2 (P-1) chunks (K and V).

    ``shape`` is the local ``[B, H, T_local, D]``; ``element_size`` in bytes.
    """
    return 2 * (world_size - 1) * math.prod(shape) * element_size


def ring_backward_bytes(
    shape: tuple[int, ...], element_size: int, world_size: int, accumulator_size: int | None = None
) -> int:
    """Bytes one rank sends in ring attention's backward.

    K and V pass P-1 times in the inputs' dtype (``element_size``), their
    gradient accumulators P times in the accumulators' (``accumulator_size``,
    default ``element_size``; 4 for bfloat16 inputs, whose accumulators are
    float32): ``2 (P-1) N e + 2 P N a`` for a local chunk of N elements, 0 on
    one rank.
    """
    if world_size == 1:
        return 0
    acc = element_size if accumulator_size is None else accumulator_size
    n = math.prod(shape)
    return 2 * (world_size - 1) * n * element_size + 2 * world_size * n * acc


def ring_saved_bytes(
    shape: tuple[int, ...], element_size: int, accumulator_size: int | None = None
) -> int:
    """Bytes ring attention saves for its backward on one rank: q, k, v, output, log-sum-exp.

    q, k and v of this rank's tokens in the inputs' dtype (``element_size``); the
    output ``[B, H, T_local, D]`` and log-sum-exp ``[B, H, T_local]`` in the
    accumulators' (``accumulator_size``, default ``element_size``; 4 for bfloat16):
    ``3 N e + N a + (N / D) a`` for a local chunk of N elements. No key or value of
    another rank stays: they pass through. So it falls as 1/P at a fixed sequence
    length, where gathering K and V keeps all ``2 P N`` of them.
    """
    acc = element_size if accumulator_size is None else accumulator_size
    n = math.prod(shape)
    return 3 * n * element_size + n * acc + n // shape[-1] * acc


def ring_comm_time(chunk_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds ring attention communicates in one layer's forward and backward (alpha-beta).

    3P-2 passes (P-1 of K and V forward, P-1 of K and V and P of their gradient
    accumulators backward), each an exchange with the neighbours of two chunks of
    ``chunk_bytes`` (S): ``(3P-2) (alpha + 2 S beta)``. Every pass is charged in
    full, one after the other: what the ring hides behind its blocks is not taken
    off (an upper bound where the blocks' compute is long). Accumulators are taken
    as large as a chunk (float32 inputs).

    Args:
        chunk_bytes: one rank's K (or V) chunk, ``B H T_local D`` elements, in bytes.
        world_size: P >= 1 (0 s on one rank).
        alpha, beta: the link's latency (s) and seconds per byte, fitted to one ring
            step (every rank sends to its right and receives from its left at once).
    """
    if world_size == 1:
        return 0.0
    return (3 * world_size - 2) * (alpha + 2 * chunk_bytes * beta)


def ulysses_comm_time(chunk_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds DeepSpeed-Ulysses communicates in one layer's forward and backward (alpha-beta).

    Eight all-to-alls of one chunk each (q, k, v and the output forward, their
    gradients backward), each by pairwise exchange, P-1 steps sending ``S/P`` to
    one rank and receiving as much from another (Thakur, Rabenseifner and Gropp,
    "Optimization of Collective Communication Operations in MPICH", 2005, section
    4.5): ``8 (P-1) (alpha + S beta / P)``. Args as :func:`ring_comm_time`.
    """
    return 8 * (world_size - 1) * (alpha + chunk_bytes * beta / world_size)


def ring_ulysses_crossover(world_size: int, alpha: float, beta: float) -> float:
    """The chunk size (bytes) at which ring attention and Ulysses communicate equally long.

    Equating :func:`ring_comm_time` and :func:`ulysses_comm_time`:
    ``S* = (alpha / beta) P (5P - 6) / (6P^2 - 12P + 8)``. Below S* the ring's
    fewer latencies (3P-2 exchanges against 8(P-1)) win; above, Ulysses' fewer
    bytes (8(P-1)/P chunks against 6P-4). S* is ``alpha / beta`` at P = 2 and
    P = 4, 27/26 of it at P = 3 (the most), and tends to 5/6 of it.

    Raises:
        ValueError: fewer than 2 ranks (nothing is sent).
    """
    if world_size < 2:
        raise ValueError(f"a crossover needs 2 ranks or more, got {world_size}")
    p = world_size
    return alpha / beta * p * (5 * p - 6) / (6 * p * p - 12 * p + 8)
