"""Context parallelism: attention over a sequence split across ranks (notebook 15).

Each rank holds ``T_local`` consecutive (or zig-zag placed) tokens of one long
sequence: its queries, keys and values are ``[B, heads, T_local, head_dim]``.
Attention needs every query against every key, so the ranks exchange keys and
values. Three ways are written from scratch; ring attention here, the other two
in :mod:`ddp_course.context_parallel_ulysses` (re-exported: ``cp.ulysses_attention``):

- **Ring attention** (:func:`ring_attention`; Liu, Zaharia and Abbeel, "Ring
  Attention with Blockwise Transformers for Near-Infinite Context", 2023,
  section 3). Key/value chunks travel around a ring of ranks with
  point-to-point sends (``dist.batch_isend_irecv``), each pass posted before
  the current chunk's compute and waited for after it (:class:`RingPass`); each
  rank attends its queries to the chunk it holds and merges the partial results
  with their log-sum-exp (:func:`merge_partials`: the online softmax of Milakov
  and Gimelshein, "Online normalizer calculation for softmax", 2018, used by Dao
  et al., "FlashAttention", 2022, section 3.1). The backward pass sends the
  keys and values around again with their gradient accumulators, which come
  home after a full turn (FlashAttention-2's backward, Dao 2023, algorithm 2,
  one block at a time).
- **Zig-zag placement** (:func:`sequence_segments` with ``layout="zigzag"``):
  with a causal mask and contiguous chunks, rank P-1 has the most keys to
  attend to and rank 0 the fewest; cutting the sequence into 2P chunks and
  giving rank r chunks r and 2P-1-r evens the work (used by Llama 3's context
  parallelism and the ring-flash-attention project). :func:`ring_step_work`
  and :func:`load_balance` count what the unevenness costs.
- **DeepSpeed-Ulysses** (``ulysses_attention``; Jacobs et al. 2023): all-to-alls
  swap sequence shards for head shards. And the simplest: gather all keys and
  values (``allgather_attention``, with the exact hand-written ``gather_sequence``).

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


def block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the q, k, v gradients, from the *final* log-sum-exp.

    FlashAttention-2's backward (Dao 2023, algorithm 2) for one block: the
    softmax weights ``P = exp(S - lse)`` with the whole row's ``lse``,
    ``dV = P^T dO``, ``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * O)``,
    ``dQ = dS K / sqrt(D)``, ``dK = dS^T Q / sqrt(D)``. Shapes as
    :func:`block_attention`; ``lse`` and ``delta`` ``[B, H, Tq]``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - lse[..., None])  # final softmax weights
    ds = p * (grad_out @ v.transpose(-2, -1) - delta[..., None])
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ grad_out


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


# ------------------------------------------------------------ communication


def _group_info(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class RingPass:
    """One ring pass in flight: ``tensors`` go to the next rank, the previous rank's come in.

    Creating it posts every send and receive at once (``dist.batch_isend_irecv``,
    which works on gloo and nccl) and returns without waiting; :meth:`wait` waits
    and returns the received tensors (contiguous, shaped and typed like the sent
    ones). Whatever runs between the two overlaps the transfer. ``tag`` tells
    two passes in flight at once apart (gloo matches messages by tag).
    """

    def __init__(self, tensors: list[torch.Tensor], group=None, tag: int = 0):
        rank, size = _group_info(group)
        nxt, prv = _global(group, (rank + 1) % size), _global(group, (rank - 1) % size)
        self._sent = [t.contiguous() for t in tensors]  # alive until the sends complete
        self.received = [torch.empty_like(t) for t in self._sent]
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(self._sent)]
        ops += [dist.P2POp(dist.irecv, r, prv, group, tag + i) for i, r in enumerate(self.received)]
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """Wait for every send and receive of this pass; the previous rank's tensors."""
        for req in self._requests:
            req.wait()
        return self.received


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


# ------------------------------------------------------------ ring attention


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ring attention accumulates in for inputs of ``dtype``: float32 or wider.

    bfloat16 and float16 inputs get float32 (FlashAttention's running output and
    log-sum-exp, torch's ``context_parallel`` with ``convert_to_f32``); float32 and
    float64 keep their own.
    """
    return torch.promote_types(dtype, torch.float32)


def _blocks_by_step(rank, size, t_local, layout, causal, doc) -> list[list[Block]]:
    steps: list[list[Block]] = [[] for _ in range(size)]
    for block in ring_schedule(rank, size, t_local, layout, causal, doc):
        steps[block.step].append(block)
    return steps


class RingAttention(torch.autograd.Function):
    """Ring attention's forward and backward (see :func:`ring_attention`).

    Keys and values travel in the inputs' dtype; each block's softmax, the running
    output and log-sum-exp (forward) and the gradient accumulators (backward, which
    travel with K and V) are in ``acc``; results are cast back to the inputs' dtype.
    Every pass is posted before the blocks of the current step are computed and
    waited for after them (:class:`RingPass`), so the transfer can hide behind them.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, document_ids, acc):
        rank, size = _group_info(group)
        doc = None if document_ids is None else document_ids.cpu()
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        q_acc, kv = q.to(acc), (k, v)
        # Every rank passes P-1 times, also at steps it computes nothing, or the ring stalls.
        for step, blocks in enumerate(_blocks_by_step(rank, size, q.shape[2], layout, causal, doc)):
            ahead = RingPass(list(kv), group) if step < size - 1 else None  # next source's K, V
            for block in blocks:
                mask = None if block.mask is None else block.mask.to(q.device)
                o, s = block_attention(q_acc[:, :, block.q], kv[0][:, :, block.kv].to(acc),
                                       kv[1][:, :, block.kv].to(acc), mask)  # fmt: skip
                out[:, :, block.q], lse[:, :, block.q] = merge_partials(
                    out[:, :, block.q], lse[:, :, block.q], o, s
                )
            if ahead is not None:
                kv = tuple(ahead.wait())
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
        grad_out = grad_out.contiguous().to(acc)
        delta = (grad_out * out).sum(-1)  # D_i = rowsum(dO * O), FlashAttention-2 eq. for dS
        q_acc = q.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, carried = (k, v), None  # carried: the dK, dV accumulators in flight
        steps = _blocks_by_step(rank, size, q.shape[2], ctx.layout, ctx.causal, doc)
        for step, blocks in enumerate(steps):
            ahead = RingPass(list(kv), group) if step < size - 1 else None
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # this step's share
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for block in blocks:
                mask = None if block.mask is None else block.mask.to(q.device)
                i, j = block.q, block.kv
                dqi, dkj, dvj = block_attention_backward(
                    q_acc[:, :, i], kv[0][:, :, j].to(acc), kv[1][:, :, j].to(acc), mask,
                    lse[:, :, i], grad_out[:, :, i], delta[:, :, i],
                )  # fmt: skip
                dq[:, :, i] += dqi
                dk[:, :, j] += dkj
                dv[:, :, j] += dvj
            if carried is not None:  # the accumulators of these K, V, from the previous rank
                dk_in, dv_in = carried.wait()
                dk, dv = dk + dk_in, dv + dv_in
            if size > 1:  # on with K, V; after the last step this hop brings them home
                carried = RingPass([dk, dv], group, tag=2)
            if ahead is not None:
                kv = tuple(ahead.wait())
        if carried is not None:
            dk, dv = carried.wait()
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
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
    Backward: P-1 passes of K and V, and P of their gradient accumulators (the
    last brings them home): :func:`ring_backward_bytes`. Each pass is posted
    before the current step's blocks are computed and waited for after them,
    the accumulators' after the blocks that add to them (:class:`RingPass`).
    Every rank passes P-1 times even where the mask leaves it nothing to compute.

    Each block is computed with ordinary tensor operations, its
    ``T_local x T_local`` scores in memory at once; production rings call a
    fused kernel that returns the log-sum-exp with the output (torch's
    ``context_parallel`` calls ``_scaled_dot_product_flash_attention`` or the
    efficient or cuDNN kernel).

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
    check_qkv(q, k, v, dist.get_world_size(group), layout, document_ids)
    acc = accumulate_dtype or accumulator_dtype(q.dtype)
    return RingAttention.apply(q, k, v, group, causal, layout, document_ids, acc)


# The other methods and the accounting live in two sibling modules; reach them from here too.
_SIBLINGS = {
    "context_parallel_ulysses": ("GatherSequence", "HeadsToSeq", "SeqToHeads",
                                 "allgather_attention", "gather_sequence", "ulysses_attention",
                                 "ulysses_backward_bytes", "ulysses_bytes"),
    "context_parallel_cost": ("load_balance", "ring_backward_bytes", "ring_bytes",
                              "ring_step_work", "ring_work"),
}  # fmt: skip


def __getattr__(name: str):
    """Names of the sibling modules (``cp.ulysses_attention``, ``cp.ring_work``), imported late."""
    for module, names in _SIBLINGS.items():
        if name in names:
            import importlib

            return getattr(importlib.import_module(f"{__package__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
