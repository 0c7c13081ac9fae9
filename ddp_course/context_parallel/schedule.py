"""Which blocks ring attention computes on each rank, step by step (notebook 15).

At ring step s rank r holds the keys and values of rank ``(r - s) mod P``; a
(query run, key run) pair is a :class:`Tile` unless the mask hides all of it.
:func:`ring_attention_schedule` lists them: :mod:`.ring` runs exactly this, forward and
backward, and :mod:`.cost` counts it, so the work per rank is read from the
schedule the ring runs, not from a formula.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .placement import attention_mask, sequence_segments


@dataclass(frozen=True)
class Tile:
    """One tile of the attention matrix (a run of queries by a run of keys) at one ring step.

    Attributes:
        step: ring step (0 = its own keys).
        source: the rank whose keys and values these are.
        q: slice of this rank's local queries.
        kv: slice of the source rank's local keys/values.
        mask: bool ``[len(q), len(kv)]`` or None (all visible).
    """

    step: int
    source: int
    q: slice
    kv: slice
    mask: torch.Tensor | None


def ring_attention_schedule(
    rank: int,
    world_size: int,
    t_local: int,
    layout: str = "contiguous",
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
    segments: Callable[[int, int, int, str], list[tuple[int, int]]] = sequence_segments,
) -> Iterator[Tile]:
    """The blocks ring attention computes on ``rank``, in order; fully masked ones are skipped.

    At step s rank r holds the keys and values of rank ``(r - s) mod P``. Both
    sides are cut into their contiguous runs (``segments``, default
    :func:`~.placement.sequence_segments`) and a (query run, key run) pair is
    computed unless the mask hides it entirely.
    :func:`~.ring.ring_attention` iterates over exactly this, forward and
    backward, so counting its blocks counts the work each rank does.

    Args:
        rank, world_size, t_local, layout: as :func:`~.placement.sequence_segments`.
        causal, document_ids: the mask, as :func:`~.placement.attention_mask`.
        segments: ``segments(rank, world_size, t_local, layout)``, the
            ``(start, length)`` runs a rank holds; another placement (or a wrong
            one, to see a check catch it: :class:`~.ring.RingOps`).

    Raises:
        ValueError: as :func:`~.placement.sequence_segments`.
    """
    q_runs = segments(rank, world_size, t_local, layout)
    for step in range(world_size):
        source = (rank - step) % world_size
        kv_runs = segments(source, world_size, t_local, layout)
        q_off = 0
        for q_start, q_len in q_runs:
            kv_off = 0
            for kv_start, kv_len in kv_runs:
                q_pos = torch.arange(q_start, q_start + q_len)
                kv_pos = torch.arange(kv_start, kv_start + kv_len)
                mask = attention_mask(q_pos, kv_pos, causal, document_ids)
                if mask is None or bool(mask.any()):
                    yield Tile(
                        step,
                        source,
                        slice(q_off, q_off + q_len),
                        slice(kv_off, kv_off + kv_len),
                        mask,
                    )
                kv_off += kv_len
            q_off += q_len
