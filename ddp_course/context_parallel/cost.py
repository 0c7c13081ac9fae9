"""What ring attention computes and sends, rank by rank (notebook 15).

The accounting of ring attention (:mod:`.ring`): the work each rank
computes, counted by walking :func:`~.schedule.ring_schedule`
(the schedule the forward and backward run, so no formula), what an uneven
split costs (:func:`load_balance`), and the bytes each rank sends
(:func:`ring_bytes` forward, :func:`ring_backward_bytes` backward).
"""

from __future__ import annotations

import math

import torch

from .schedule import ring_schedule

__all__ = ["load_balance", "ring_backward_bytes", "ring_bytes", "ring_step_work", "ring_work"]


def ring_work(
    world_size: int,
    t_local: int,
    layout: str = "contiguous",
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
) -> list[dict[str, int]]:
    """Work per rank, counted by walking :func:`ring_schedule` (no formula).

    Returns:
        One dict per rank: ``blocks`` (products computed), ``pairs`` (query-key
        scores computed, the blocks' sizes) and ``visible`` (scores the mask keeps).
    """
    work = []
    for rank in range(world_size):
        blocks = list(ring_schedule(rank, world_size, t_local, layout, causal, document_ids))
        work.append({
            "blocks": len(blocks),
            "pairs": sum(_pairs(b) for b in blocks),
            "visible": sum(_visible(b) for b in blocks),
        })  # fmt: skip
    return work


def _pairs(block) -> int:
    return (block.q.stop - block.q.start) * (block.kv.stop - block.kv.start)


def _visible(block) -> int:
    return _pairs(block) if block.mask is None else int(block.mask.sum())


def ring_step_work(
    world_size: int,
    t_local: int,
    layout: str = "contiguous",
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
) -> list[list[int]]:
    """Visible query-key pairs per rank and ring step, ``[rank][step]`` (:func:`ring_schedule`)."""
    grid = [[0] * world_size for _ in range(world_size)]
    for rank in range(world_size):
        for b in ring_schedule(rank, world_size, t_local, layout, causal, document_ids):
            grid[rank][b.step] += _visible(b)
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


def ring_bytes(shape: tuple[int, ...], element_size: int, world_size: int) -> int:
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
