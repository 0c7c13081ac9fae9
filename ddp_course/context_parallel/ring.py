"""Ring attention: keys and values passed around a ring of ranks (notebook 15).

Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", 2023, section 3. Key/value chunks travel around a ring
of ranks with point-to-point sends (``dist.batch_isend_irecv``), each pass
posted before the current chunk's compute and waited for after it
(:class:`RingPass`); each rank attends its queries to the chunk it holds
(:func:`~.blockwise.block_attention`) and merges the partial results with their
log-sum-exp (:func:`~.blockwise.merge_partials`). The backward pass sends the
keys and values around again with their gradient accumulators, which come home
after a full turn (FlashAttention-2's backward, Dao 2023, algorithm 2, one block
at a time). The blocks each rank computes are :func:`~.schedule.ring_attention_schedule`'s.

:class:`RingOps` names the pieces the ring calls; pass another to count the
block products, log the passes, or make a mistake on purpose and see a check
catch it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .blockwise import block_attention, block_attention_backward, merge_partials
from .placement import check_qkv, sequence_segments
from .schedule import Tile, ring_attention_schedule


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


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ring attention accumulates in for inputs of ``dtype``: float32 or wider.

    bfloat16 and float16 inputs get float32 (FlashAttention's running output and
    log-sum-exp, torch's ``context_parallel`` with ``convert_to_f32``); float32 and
    float64 keep their own.
    """
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class RingOps:
    """The pieces ring attention calls; the defaults are the real ones.

    Give :func:`ring_attention` another to watch or change one piece without
    touching the rest, e.g. ``RingOps(block=counting_block)`` to count the block
    products a rank computes, a :class:`RingPass` subclass that logs when each
    pass is posted and waited for, or a wrong merge to see a check fail.

    Attributes:
        block: ``block(q, k, v, mask) -> (out, lse)``, as
            :func:`~.blockwise.block_attention`; called once per block, forward.
        block_backward: ``(q, k, v, mask, lse, grad_out, delta) -> (dq, dk, dv)``,
            as :func:`~.blockwise.block_attention_backward`; once per block, backward.
        merge: ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``, as
            :func:`~.blockwise.merge_partials`.
        ring_pass: the class that posts a pass (``ring_pass(tensors, group, tag)``)
            and waits for it (``.wait()``), as :class:`RingPass`.
        segments: the runs each rank holds, as
            :func:`~.placement.sequence_segments` (passed to
            :func:`~.schedule.ring_attention_schedule`).
    """

    block: Callable = block_attention
    block_backward: Callable = block_attention_backward
    merge: Callable = merge_partials
    ring_pass: type[RingPass] = RingPass
    segments: Callable = sequence_segments


def _blocks_by_step(rank, size, t_local, layout, causal, doc, segments) -> list[list[Tile]]:
    steps: list[list[Tile]] = [[] for _ in range(size)]
    for block in ring_attention_schedule(rank, size, t_local, layout, causal, doc, segments):
        steps[block.step].append(block)
    return steps


class RingAttention(torch.autograd.Function):
    """Ring attention's forward and backward (see :func:`ring_attention`).

    Keys and values travel in the inputs' dtype; each block's softmax, the running
    output and log-sum-exp (forward) and the gradient accumulators (backward, which
    travel with K and V) are in ``acc``; results are cast back to the inputs' dtype.
    Every pass is posted before the blocks of the current step are computed and
    waited for after them (:class:`RingPass`), so the transfer can hide behind them.
    ``ops`` (:class:`RingOps`) is what it calls for blocks, merges, passes and placement.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, document_ids, acc, ops):
        rank, size = _group_info(group)
        doc = None if document_ids is None else document_ids.cpu()
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        q_acc, kv = q.to(acc), (k, v)
        # Every rank passes P-1 times, also at steps it computes nothing, or the ring stalls.
        steps = _blocks_by_step(rank, size, q.shape[2], layout, causal, doc, ops.segments)
        for step, blocks in enumerate(steps):
            # The next source's K, V: posted now, waited for after this step's blocks.
            ahead = ops.ring_pass(list(kv), group) if step < size - 1 else None
            for block in blocks:
                mask = None if block.mask is None else block.mask.to(q.device)
                o, s = ops.block(
                    q_acc[:, :, block.q],
                    kv[0][:, :, block.kv].to(acc),
                    kv[1][:, :, block.kv].to(acc),
                    mask,
                )
                out[:, :, block.q], lse[:, :, block.q] = ops.merge(
                    out[:, :, block.q], lse[:, :, block.q], o, s
                )
            if ahead is not None:
                kv = tuple(ahead.wait())
        # out and lse kept in acc: with lse rounded to bfloat16 the backward's softmax
        # rows sum to 0.985-1.016 instead of 1 (measured, causal, T = 512, lse up to 7).
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.group, ctx.causal, ctx.layout, ctx.ops = group, causal, layout, ops
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        group, acc, ops = ctx.group, out.dtype, ctx.ops
        rank, size = _group_info(group)
        doc = None if document_ids is None else document_ids.cpu()
        grad_out = grad_out.contiguous().to(acc)
        delta = (grad_out * out).sum(-1)  # D_i = rowsum(dO * O), FlashAttention-2 eq. for dS
        q_acc = q.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, carried = (k, v), None  # carried: the dK, dV accumulators in flight
        steps = _blocks_by_step(rank, size, q.shape[2], ctx.layout, ctx.causal, doc, ops.segments)
        for step, blocks in enumerate(steps):
            ahead = ops.ring_pass(list(kv), group) if step < size - 1 else None
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # this step's share
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for block in blocks:
                mask = None if block.mask is None else block.mask.to(q.device)
                i, j = block.q, block.kv
                dqi, dkj, dvj = ops.block_backward(
                    q_acc[:, :, i],
                    kv[0][:, :, j].to(acc),
                    kv[1][:, :, j].to(acc),
                    mask,
                    lse[:, :, i],
                    grad_out[:, :, i],
                    delta[:, :, i],
                )
                dq[:, :, i] += dqi
                dk[:, :, j] += dkj
                dv[:, :, j] += dvj
            if carried is not None:  # the accumulators of these K, V, from the previous rank
                dk_in, dv_in = carried.wait()
                dk, dv = dk + dk_in, dv + dv_in
            if size > 1:  # on with K, V; after the last step this hop brings them home
                carried = ops.ring_pass([dk, dv], group, tag=2)
            if ahead is not None:
                kv = tuple(ahead.wait())
        if carried is not None:
            dk, dv = carried.wait()
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return *grads, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "contiguous",
    document_ids: torch.Tensor | None = None,
    accumulate_dtype: torch.dtype | None = None,
    ops: RingOps | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group``, keys/values passed in a ring.

    Equal (forward and gradients of q, k, v) to ``scaled_dot_product_attention``
    on the whole sequence, for this rank's queries. Forward: P-1 ring steps,
    each sending this rank's current K and V chunk to the next rank, so every
    rank sends ``2 (P-1) B H T_local D`` elements (:func:`~.cost.ring_attention_bytes`).
    Backward: P-1 passes of K and V, and P of their gradient accumulators (the
    last brings them home): :func:`~.cost.ring_backward_bytes`. Each pass is posted
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

    Liu et al. 2023 (Ring Attention, section 3); merge: :func:`~.blockwise.merge_partials`.

    Args:
        q, k, v: ``[B, heads, T_local, head_dim]``, this rank's tokens (placed by
            ``layout``, see :func:`~.placement.shard_sequence`), any float dtype.
        group: the process group (default: the world).
        causal: apply the global causal mask.
        layout: ``"contiguous"`` or ``"zigzag"`` (:func:`~.placement.sequence_segments`).
        document_ids: int64 ``[P * T_local]``, the document of every global
            position, the same on every rank; attention stays inside documents.
        accumulate_dtype: the accumulators' dtype (default: float32 or wider);
            ``torch.bfloat16`` with bfloat16 inputs rounds at every merge, to see
            what float32 saves.
        ops: the pieces it calls (default ``RingOps()``, the real ones);
            another to count blocks, log passes or break one piece on purpose.

    Returns:
        ``[B, heads, T_local, head_dim]``, same dtype as ``q``; so are the gradients.

    Raises:
        ValueError: shapes differ or are not 4-D, zigzag with odd ``T_local``,
            ``document_ids`` of the wrong length.
    """
    check_qkv(q, k, v, dist.get_world_size(group), layout, document_ids)
    acc = accumulate_dtype or accumulator_dtype(q.dtype)
    return RingAttention.apply(q, k, v, group, causal, layout, document_ids, acc, ops or RingOps())
