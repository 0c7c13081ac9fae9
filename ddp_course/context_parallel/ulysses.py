"""Context parallelism by collectives: DeepSpeed-Ulysses and the all-gather version (notebook 15).

The alternatives to the ring (:mod:`.ring`); placement and masks as in
:mod:`.placement`.

- **DeepSpeed-Ulysses** (:func:`ulysses_attention`; Jacobs et al., "DeepSpeed
  Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
  Transformer Models", 2023, section 3): one all-to-all turns the
  sequence-sharded q, k, v into head-sharded ones over the whole sequence,
  every rank runs ordinary attention for heads/P heads, and one all-to-all
  turns the output back. Backward: the same all-to-alls in reverse.
- **All-gather** (:func:`allgather_attention`): every rank gathers all keys
  and values (:func:`gather_sequence`, hand-written and exact on every backend).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn import functional as F

from .placement import attention_mask, check_qkv, sequence_positions

__all__ = [
    "GatherSequence",
    "HeadsToSeq",
    "SeqToHeads",
    "allgather_attention",
    "gather_sequence",
    "ulysses_attention",
    "ulysses_backward_bytes",
    "ulysses_bytes",
]


def _global_mask(rank, size, t_local, layout, causal, document_ids, device, q_all=False):
    """Mask of this rank's queries (all queries if ``q_all``) to all keys, in rank order."""
    k_pos = torch.cat([sequence_positions(r, size, t_local, layout) for r in range(size)])
    q_pos = k_pos if q_all else sequence_positions(rank, size, t_local, layout)
    doc = None if document_ids is None else document_ids.cpu()
    mask = attention_mask(q_pos, k_pos, causal, doc)
    return None if mask is None else mask.to(device)


# --------------------------------------------------------------- all-gather


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2); backward: sum over ranks, keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.t_local = group, rank, x.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's loss used this rank's slice: its gradient is the sum over
        # ranks of their gradient's slice. One contiguous buffer, reduced in place:
        # no receive buffer shaped like the incoming gradient (torch's deprecated
        # differentiable all_gather, on gloo, scatters into buffers laid out like
        # it, and gloo's scatter fills a non-contiguous buffer in memory order,
        # pytorch/pytorch#24836: the gradients come out permuted).
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.t_local
        return grad[:, :, start : start + ctx.t_local].contiguous(), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All ranks' tokens, rank 0's first: ``[B, H, T_local, D]`` -> ``[B, H, P*T_local, D]``.

    Differentiable and exact: the backward all-reduces the (contiguous) incoming
    gradient and returns this rank's slice. The order of the result is by rank,
    so global positions are ``cat(sequence_positions(r) for r)``.
    """
    return GatherSequence.apply(x, group)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "contiguous",
    document_ids: torch.Tensor | None = None,
    gather=gather_sequence,
) -> torch.Tensor:
    """Attention of this rank's queries to all keys and values, gathered with one all-gather each.

    Args as :func:`~.ring.ring_attention`; ``gather(x, group)``
    gathers along dim 2 (default :func:`gather_sequence`). Memory: every rank
    holds all keys and values. The mask is always a tensor: this rank's queries
    start mid-sequence, and ``is_causal=True`` would align the triangle with the
    first key (on a GPU a mask tensor rules out the flash kernel).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    check_qkv(q, k, v, size, layout, document_ids)
    k_all, v_all = gather(k, group), gather(v, group)
    mask = _global_mask(rank, size, q.shape[2], layout, causal, document_ids, q.device)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


# ---------------------------------------------------------------- Ulysses


def _seq_to_heads(x, group):
    # [B, H, T_local, D] -> [B, H/P, P*T_local, D]: head group j goes to rank j.
    b, h, t, d = x.shape
    size = dist.get_world_size(group)
    send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens, my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _heads_to_seq(y, group):
    # [B, H/P, P*T_local, D] -> [B, H, T_local, D]: the inverse of _seq_to_heads.
    b, hp, t_all, d = y.shape
    size = dist.get_world_size(group)
    t = t_all // size
    send = y.reshape(b, hp, size, t, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: my tokens, rank j's heads
    return recv.transpose(0, 1).reshape(b, size * hp, t, d)


class SeqToHeads(torch.autograd.Function):
    """All-to-all from sequence-sharded to head-sharded; its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """All-to-all from head-sharded back to sequence-sharded (inverse of :class:`SeqToHeads`)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "contiguous",
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to heads, whole-sequence attention, all-to-all back.

    Jacobs et al. 2023, section 3. Each rank sends ``(P-1)/P`` of its local q,
    k, v and output: ``4 (P-1)/P B H T_local D`` elements per layer forward
    (:func:`ulysses_bytes`), and as much again backward. Parallelism is bounded
    by the number of heads. With contiguous placement, a plain causal mask and
    no documents the gathered sequence is in order, so the attention runs with
    ``is_causal=True`` (no mask tensor: on a GPU the flash kernel may run).

    Args, returns: as :func:`~.ring.ring_attention`.

    Raises:
        ValueError: ``heads`` not divisible by the world size (use a world size
            that divides the heads, or ring attention), or bad shapes as
            :func:`~.ring.ring_attention`.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    check_qkv(q, k, v, size, layout, document_ids)
    if q.shape[1] % size:
        raise ValueError(
            f"Ulysses splits heads over ranks: {q.shape[1]} heads are not divisible by "
            f"{size} ranks; use a world size dividing the heads, or ring attention"
        )
    qh, kh, vh = (SeqToHeads.apply(x, group) for x in (q, k, v))
    if causal and layout == "contiguous" and document_ids is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:  # the gathered sequence is in rank order; the mask follows its global positions
        mask = _global_mask(rank, size, q.shape[2], layout, causal, document_ids, q.device, True)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return HeadsToSeq.apply(out, group)


def ulysses_bytes(shape: tuple[int, ...], element_size: int, world_size: int) -> int:
    """Bytes one rank sends in Ulysses' forward: ``4 (P-1)/P`` of the local q, k, v, output.

    ``shape`` is the local ``[B, H, T_local, D]``; ``element_size`` in bytes.
    """
    return 4 * (world_size - 1) * math.prod(shape) * element_size // world_size


def ulysses_backward_bytes(shape: tuple[int, ...], element_size: int, world_size: int) -> int:
    """Bytes one rank sends in Ulysses' backward: the same four all-to-alls, reversed.

    The output's gradient goes to heads (one), the q, k, v gradients back to the
    sequence (three): ``4 (P-1)/P`` chunks, as forward.
    """
    return ulysses_bytes(shape, element_size, world_size)
