"""Where each rank's tokens sit in the sequence, and which keys a query may see (notebook 15).

Each rank holds ``T_local`` tokens of one long sequence, in one run
(``contiguous``) or two (``zigzag``: chunks r and 2P-1-r of 2P, which evens the
causal work, as in Llama 3's context parallelism and the ring-flash-attention
project): :func:`sequence_segments`, :func:`sequence_positions`,
:func:`shard_sequence`. Masks are global: a query at position i sees a key at
position j when ``j <= i`` (causal) and, for packed documents, when both carry
the same document id (:func:`attention_mask`). :func:`check_qkv` validates what
every context-parallel attention is given.
"""

from __future__ import annotations

import torch

PLACEMENTS = ("contiguous", "zigzag")


def sequence_segments(
    rank: int, world_size: int, t_local: int, layout: str = "contiguous"
) -> list[tuple[int, int]]:
    """The runs of the global sequence a rank holds, as ``(start, length)`` pairs.

    ``contiguous``: rank r holds positions ``[r*T_local, (r+1)*T_local)``.
    ``zigzag``: the sequence is cut into 2P chunks of ``T_local/2`` tokens and
    rank r holds chunk r then chunk 2P-1-r, so under a causal mask each rank
    has one "early" chunk (few keys before it) and one "late" one.

    Args:
        rank, world_size: this rank and the number of ranks P.
        t_local: tokens per rank.
        layout: ``"contiguous"`` or ``"zigzag"``.

    Raises:
        ValueError: an unknown layout, or zigzag with an odd ``t_local``.
    """
    if layout not in PLACEMENTS:
        raise ValueError(f"layout must be one of {PLACEMENTS}, got {layout!r}")
    if layout == "contiguous":
        return [(rank * t_local, t_local)]
    if t_local % 2:
        raise ValueError(f"zigzag needs an even number of tokens per rank, got {t_local}")
    half = t_local // 2
    return [(rank * half, half), ((2 * world_size - 1 - rank) * half, half)]


def sequence_positions(
    rank: int, world_size: int, t_local: int, layout: str = "contiguous"
) -> torch.Tensor:
    """Global positions (int64, ``[T_local]``) of a rank's tokens, in local order."""
    return torch.cat(
        [torch.arange(s, s + n) for s, n in sequence_segments(rank, world_size, t_local, layout)]
    )


def shard_sequence(
    x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous", dim: int = 2
) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (e.g. ``[B, H, T, D]`` -> ``[B, H, T/P, D]``).

    Raises:
        ValueError: the sequence length is not divisible by ``world_size``.
    """
    t = x.shape[dim]
    if t % world_size:
        raise ValueError(f"sequence length {t} is not divisible by {world_size} ranks")
    pos = sequence_positions(rank, world_size, t // world_size, layout).to(x.device)
    return x.index_select(dim, pos)


def attention_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Which keys each query may see: bool ``[len(q_pos), len(k_pos)]``, or None (all).

    Args:
        q_pos, k_pos: global positions (int64) of the queries and of the keys.
        causal: a key at position j is visible from position i when ``j <= i``.
        document_ids: int64 ``[T]``, the document of every global position (same
            on every rank); then only keys of the query's own document are visible.
    """
    mask = None
    if causal:
        mask = k_pos[None, :] <= q_pos[:, None]
    if document_ids is not None:
        same = document_ids[q_pos][:, None] == document_ids[k_pos][None, :]
        mask = same if mask is None else mask & same
    return mask


def check_qkv(q, k, v, world_size, layout, document_ids) -> None:
    """Raise ValueError unless q, k, v are ``[B, H, T_local, D]`` alike, ``layout`` fits
    ``T_local`` and ``document_ids`` holds one id per global position."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "q, k, v must have the same shape [batch, heads, T_local, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    sequence_segments(0, world_size, q.shape[2], layout)  # raises on a bad layout
    if document_ids is not None and document_ids.shape != (world_size * q.shape[2],):
        raise ValueError(
            f"document_ids must hold one id per global position, shape "
            f"({world_size * q.shape[2]},), got {tuple(document_ids.shape)}"
        )
