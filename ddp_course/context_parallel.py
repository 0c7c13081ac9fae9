"""Context parallelism: attention over a sequence split across ranks (notebook 15).

Each rank holds ``T_local`` consecutive (or zig-zag placed) tokens of one long
sequence: its queries, keys and values are ``[B, heads, T_local, head_dim]``.
Attention needs every query against every key, so the ranks exchange keys and
values. Three ways are written here from scratch:

- **Ring attention** (:func:`ring_attention`; Liu, Zaharia and Abbeel, "Ring
  Attention with Blockwise Transformers for Near-Infinite Context", 2023,
  section 3). Key/value chunks travel around a ring of ranks with
  point-to-point sends (``dist.batch_isend_irecv``); each rank attends its
  queries to the chunk it holds and merges the partial results with their
  log-sum-exp (:func:`merge_partials`: the online softmax of Milakov and
  Gimelshein, "Online normalizer calculation for softmax", 2018, used by Dao
  et al., "FlashAttention", 2022, section 3.1). The backward pass sends the
  keys and values around again with their gradient accumulators, which come
  home after a full turn (FlashAttention-2's backward, Dao 2023, algorithm 2,
  one block at a time).
- **Zig-zag placement** (:func:`sequence_segments` with ``layout="zigzag"``):
  with a causal mask and contiguous chunks, rank P-1 has the most keys to
  attend to and rank 0 the fewest; cutting the sequence into 2P chunks and
  giving rank r chunks r and 2P-1-r evens the work (used by Llama 3's context
  parallelism and the ring-flash-attention project).
- **DeepSpeed-Ulysses** (:func:`ulysses_attention`; Jacobs et al., "DeepSpeed
  Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
  Transformer Models", 2023, section 3): one all-to-all turns the
  sequence-sharded q, k, v into head-sharded ones over the whole sequence,
  every rank runs ordinary attention for heads/P heads, and one all-to-all
  turns the output back.

And the simplest: gather all keys and values (:func:`allgather_attention`,
with the exact hand-written :func:`gather_sequence`).

Masks are global: every rank knows the positions its tokens hold in the whole
sequence (:func:`sequence_positions`), and a query at position i sees a key at
position j when ``j <= i`` (causal) and, for packed documents, when both carry
the same document id (:func:`attention_mask`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------- placement


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
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
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


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One process, whole sequence: ``F.scaled_dot_product_attention`` with the global mask."""
    pos = torch.arange(q.shape[2], device=q.device)
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    mask = attention_mask(pos, pos, causal, document_ids.to(q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ---------------------------------------------------------- blockwise softmax


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries to one block of keys, with its log-sum-exp.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, H, Tk, D]`` (any float dtype).
        mask: bool ``[Tq, Tk]`` (True = visible) or None.

    Returns:
        ``(out, lse)``: ``out`` ``[B, H, Tq, D]`` is softmax over this block only
        times ``v``; ``lse`` ``[B, H, Tq]`` is ``log(sum_j exp(s_ij))`` over the
        visible keys, ``-inf`` for a query that sees none (its ``out`` row is 0).
        Scores are scaled by ``1/sqrt(D)`` as in ``scaled_dot_product_attention``.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # no -inf - -inf
    return torch.exp(scores - safe[..., None]) @ v, lse


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets (the online softmax).

    With ``lse = log(exp(lse_a) + exp(lse_b))`` the exact attention over both
    key sets is ``out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``
    (Milakov and Gimelshein 2018; FlashAttention, Dao et al. 2022, section 3.1).
    Shapes as in :func:`block_attention`; rows where both are ``-inf`` stay 0.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = out_a * torch.exp(lse_a - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]
    return out, lse


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: int,
    causal: bool = True,
    accumulate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One process: attention over the whole sequence computed as ``chunks`` key blocks merged.

    What ring attention computes on ``chunks`` ranks, here in one loop. Each
    block's partial result is computed in the inputs' dtype; the running output
    and log-sum-exp are kept in ``accumulate_dtype`` (default: the inputs'
    dtype, so in bfloat16 every merge rounds; FlashAttention keeps them in
    float32). Returns ``[B, H, T, D]`` in the inputs' dtype.

    Raises:
        ValueError: the sequence length is not divisible by ``chunks``.
    """
    t = k.shape[2]
    if t % chunks:
        raise ValueError(f"sequence length {t} is not divisible by {chunks} chunks")
    acc = accumulate_dtype or q.dtype
    n = t // chunks
    pos = torch.arange(t, device=q.device)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for c in range(chunks):
        kv = slice(c * n, (c + 1) * n)
        mask = attention_mask(pos, pos[kv], causal)
        o, s = block_attention(q, k[:, :, kv], v[:, :, kv], mask)
        out, lse = merge_partials(out, lse, o.to(acc), s.to(acc))
    return out.to(q.dtype)


# ------------------------------------------------------------- ring schedule


@dataclass(frozen=True)
class Block:
    """One product a rank computes at one ring step.

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


def ring_schedule(
    rank: int,
    world_size: int,
    t_local: int,
    layout: str = "contiguous",
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
) -> Iterator[Block]:
    """The blocks ring attention computes on ``rank``, in order; fully masked ones are skipped.

    At step s rank r holds the keys and values of rank ``(r - s) mod P``. Both
    sides are cut into their contiguous runs (:func:`sequence_segments`) and a
    (query run, key run) pair is computed unless the mask hides it entirely.
    :func:`ring_attention` iterates over exactly this, forward and backward, so
    counting its blocks counts the work each rank does.
    """
    q_runs = sequence_segments(rank, world_size, t_local, layout)
    for step in range(world_size):
        source = (rank - step) % world_size
        kv_runs = sequence_segments(source, world_size, t_local, layout)
        q_off = 0
        for q_start, q_len in q_runs:
            kv_off = 0
            for kv_start, kv_len in kv_runs:
                q_pos = torch.arange(q_start, q_start + q_len)
                kv_pos = torch.arange(kv_start, kv_start + kv_len)
                mask = attention_mask(q_pos, kv_pos, causal, document_ids)
                if mask is None or bool(mask.any()):
                    yield Block(step, source, slice(q_off, q_off + q_len),
                                slice(kv_off, kv_off + kv_len), mask)  # fmt: skip
                kv_off += kv_len
            q_off += q_len


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
            "pairs": sum((b.q.stop - b.q.start) * (b.kv.stop - b.kv.start) for b in blocks),
            "visible": sum(
                (b.q.stop - b.q.start) * (b.kv.stop - b.kv.start) if b.mask is None
                else int(b.mask.sum()) for b in blocks),
        })  # fmt: skip
    return work


# ------------------------------------------------------------ communication


def _group_info(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def ring_pass(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring and return the previous rank's.

    Point-to-point, all sends and receives posted together with
    ``dist.batch_isend_irecv`` (works on gloo and nccl). Each rank sends the
    bytes of ``tensors`` once.
    """
    rank, size = _group_info(group)
    nxt, prv = _global(group, (rank + 1) % size), _global(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def _check_qkv(q, k, v, world_size, layout, document_ids):
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


# ------------------------------------------------------------ ring attention


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ring attention accumulates in for inputs of ``dtype``: float32 or wider.

    bfloat16 and float16 inputs get float32 (FlashAttention's running output and
    log-sum-exp, torch's ``context_parallel`` with ``convert_to_f32``); float32 and
    float64 keep their own.
    """
    return torch.promote_types(dtype, torch.float32)


class RingAttention(torch.autograd.Function):
    """Ring attention's forward and backward (see :func:`ring_attention`).

    Keys and values travel in the inputs' dtype; each block's softmax, the running
    output and log-sum-exp (forward) and the gradient accumulators (backward, which
    travel with K and V) are in ``acc``; results are cast back to the inputs' dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, document_ids, acc):
        rank, size = _group_info(group)
        doc = None if document_ids is None else document_ids.cpu()
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        q_acc = q.to(acc)
        kv, step = (k, v), 0
        for block in ring_schedule(rank, size, q.shape[2], layout, causal, doc):
            while block.step > step:  # the next source's keys and values
                kv, step = ring_pass(list(kv), group), step + 1
            mask = None if block.mask is None else block.mask.to(q.device)
            o, s = block_attention(q_acc[:, :, block.q], kv[0][:, :, block.kv].to(acc),
                                   kv[1][:, :, block.kv].to(acc), mask)  # fmt: skip
            out[:, :, block.q], lse[:, :, block.q] = merge_partials(
                out[:, :, block.q], lse[:, :, block.q], o, s
            )
        while step < size - 1:  # every rank passes P-1 times, or the ring stalls
            kv, step = ring_pass(list(kv), group), step + 1
        # out and lse kept in acc: with lse rounded to bfloat16 the backward's softmax
        # rows sum to 0.985-1.016 instead of 1 (measured, causal, T = 512, lse up to 7).
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.group, ctx.causal, ctx.layout = group, causal, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        group, acc = ctx.group, out.dtype
        rank, size = _group_info(group)
        doc = None if document_ids is None else document_ids.cpu()
        scale = 1.0 / math.sqrt(q.shape[-1])
        grad_out = grad_out.contiguous().to(acc)
        delta = (grad_out * out).sum(-1)  # D_i = rowsum(dO * O), FlashAttention-2 eq. for dS
        q_acc = q.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        dk_cur = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_cur = torch.zeros(v.shape, dtype=acc, device=v.device)
        step = 0
        for block in ring_schedule(rank, size, q.shape[2], ctx.layout, ctx.causal, doc):
            while block.step > step:
                k_cur, v_cur, dk_cur, dv_cur = ring_pass([k_cur, v_cur, dk_cur, dv_cur], group)
                step += 1
            qi = q_acc[:, :, block.q]
            kj, vj = k_cur[:, :, block.kv].to(acc), v_cur[:, :, block.kv].to(acc)
            scores = (qi @ kj.transpose(-2, -1)) * scale
            if block.mask is not None:
                scores = scores.masked_fill(~block.mask.to(q.device), float("-inf"))
            p = torch.exp(scores - lse[:, :, block.q][..., None])  # final softmax weights
            do = grad_out[:, :, block.q]
            dv_cur[:, :, block.kv] += p.transpose(-2, -1) @ do
            ds = p * (do @ vj.transpose(-2, -1) - delta[:, :, block.q][..., None])
            dq[:, :, block.q] += (ds @ kj) * scale
            dk_cur[:, :, block.kv] += (ds.transpose(-2, -1) @ qi) * scale
        while step < size - 1:
            k_cur, v_cur, dk_cur, dv_cur = ring_pass([k_cur, v_cur, dk_cur, dv_cur], group)
            step += 1
        if size > 1:  # one more hop brings each accumulator back to its owner
            dk_cur, dv_cur = ring_pass([dk_cur, dv_cur], group)
        grads = dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype)
        return *grads, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "contiguous",
    document_ids: torch.Tensor | None = None,
    accumulate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group``, keys/values passed in a ring.

    Equal (forward and gradients of q, k, v) to ``scaled_dot_product_attention``
    on the whole sequence, for this rank's queries. Forward: P-1 ring steps,
    each sending this rank's current K and V chunk to the next rank, so every
    rank sends ``2 (P-1) B H T_local D`` elements (:func:`ring_bytes`).
    Backward: P-1 steps sending K, V and their gradient accumulators, plus one
    sending the accumulators home.

    Precision: K and V travel in the inputs' dtype; each block's softmax, the
    running output and log-sum-exp, and the gradient accumulators are kept in
    ``accumulate_dtype`` (default :func:`accumulator_dtype`: float32 for bfloat16
    and float16 inputs, as FlashAttention and torch's ``context_parallel`` do), and
    the results are rounded to the inputs' dtype once, at the end. In bfloat16
    the accumulators then cost 4 bytes per element in the backward's sends.

    Liu et al. 2023 (Ring Attention, section 3); merge: :func:`merge_partials`.

    Args:
        q, k, v: ``[B, heads, T_local, head_dim]``, this rank's tokens (placed by
            ``layout``, see :func:`shard_sequence`), any float dtype.
        group: the process group (default: the world).
        causal: apply the global causal mask.
        layout: ``"contiguous"`` or ``"zigzag"`` (:func:`sequence_segments`).
        document_ids: int64 ``[P * T_local]``, the document of every global
            position, the same on every rank; attention stays inside documents.
        accumulate_dtype: the accumulators' dtype (default: float32 or wider);
            ``torch.bfloat16`` with bfloat16 inputs rounds at every merge, to see
            what float32 saves.

    Returns:
        ``[B, heads, T_local, head_dim]``, same dtype as ``q``; so are the gradients.

    Raises:
        ValueError: shapes differ or are not 4-D, zigzag with odd ``T_local``,
            ``document_ids`` of the wrong length.
    """
    _check_qkv(q, k, v, dist.get_world_size(group), layout, document_ids)
    acc = accumulate_dtype or accumulator_dtype(q.dtype)
    return RingAttention.apply(q, k, v, group, causal, layout, document_ids, acc)


def ring_bytes(shape: tuple[int, ...], element_size: int, world_size: int) -> int:
    """Bytes one rank sends in ring attention's forward: 2 (P-1) chunks (K and V).

    ``shape`` is the local ``[B, H, T_local, D]``; ``element_size`` in bytes.
    """
    return 2 * (world_size - 1) * math.prod(shape) * element_size


# --------------------------------------------------------------- all-gather


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2); backward: sum over ranks, keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        rank, size = _group_info(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.t_local = group, rank, x.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's loss used this rank's slice: its gradient is the sum over
        # ranks of their gradient's slice. One contiguous buffer, reduced in place:
        # no receive buffer shaped like the incoming gradient (torch's deprecated
        # differentiable all_gather, on gloo, receives into buffers laid out like
        # it and gets scrambled gradients when they are permuted, e.g. the
        # [B, T, H, D] memory order SDPA's backward returns with several heads).
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

    Args as :func:`ring_attention`; ``gather(x, group)`` gathers along dim 2
    (default :func:`gather_sequence`). Memory: every rank holds all keys and values.
    """
    rank, size = _group_info(group)
    _check_qkv(q, k, v, size, layout, document_ids)
    t_local = q.shape[2]
    k_all, v_all = gather(k, group), gather(v, group)
    k_pos = torch.cat([sequence_positions(r, size, t_local, layout) for r in range(size)])
    q_pos = sequence_positions(rank, size, t_local, layout)
    doc = None if document_ids is None else document_ids.cpu()
    mask = attention_mask(q_pos, k_pos, causal, doc)
    mask = None if mask is None else mask.to(q.device)
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
    (:func:`ulysses_bytes`). Parallelism is bounded by the number of heads.

    Args, returns: as :func:`ring_attention`.

    Raises:
        ValueError: ``heads`` not divisible by the world size (use a world size
            that divides the heads, or ring attention), or bad shapes as
            :func:`ring_attention`.
    """
    rank, size = _group_info(group)
    _check_qkv(q, k, v, size, layout, document_ids)
    if q.shape[1] % size:
        raise ValueError(
            f"Ulysses splits heads over ranks: {q.shape[1]} heads are not divisible by "
            f"{size} ranks; use a world size dividing the heads, or ring attention"
        )
    qh, kh, vh = (SeqToHeads.apply(x, group) for x in (q, k, v))
    # The gathered sequence is in rank order; the mask follows its global positions.
    pos = torch.cat([sequence_positions(r, size, q.shape[2], layout) for r in range(size)])
    doc = None if document_ids is None else document_ids.cpu()
    mask = attention_mask(pos, pos, causal, doc)
    mask = None if mask is None else mask.to(q.device)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return HeadsToSeq.apply(out, group)


def ulysses_bytes(shape: tuple[int, ...], element_size: int, world_size: int) -> int:
    """Bytes one rank sends in Ulysses' forward: ``4 (P-1)/P`` of the local q, k, v, output.

    ``shape`` is the local ``[B, H, T_local, D]``; ``element_size`` in bytes.
    """
    return 4 * (world_size - 1) * math.prod(shape) * element_size // world_size
