"""Attention over blocks of keys, merged by their log-sum-exp: the ring's arithmetic (notebook 15).

:func:`block_attention` attends queries to one block of keys and returns the
log-sum-exp with the output; :func:`merge_partials` merges two such partial
results exactly (the online softmax of Milakov and Gimelshein, "Online
normalizer calculation for softmax", 2018, used by Dao et al., "FlashAttention",
2022, section 3.1); :func:`block_attention_backward` is one block's share of the
gradients from the final log-sum-exp (FlashAttention-2's backward, Dao 2023,
algorithm 2). :func:`blockwise_attention` runs the forward in one process, block
after block, and :func:`reference_attention` is what every method must equal:
``scaled_dot_product_attention`` on the whole sequence.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from .placement import attention_mask


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
