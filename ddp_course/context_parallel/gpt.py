"""Context parallelism inside a model: TinyGPT with its sequence split over ranks (notebook 15).

Attention is the one layer whose tokens meet; everything else in a Transformer
works token by token, so a context-parallel rank runs it on its own tokens
unchanged. Three things change besides attention (picotron's
``update_rope_for_context_parallel``; torchtitan's ``context_parallel``, which
folds the context-parallel ranks into the data-parallel mesh dimension
``dp_shard_cp``):

- **Positions are global.** A rank holds tokens from the middle of the sequence
  (two runs of it under zig-zag placement): its position embeddings must be
  those of :func:`~.placement.sequence_positions`, not ``0..T_local-1``.
- **The loss is normalised over the whole sequence.** Each rank sums its
  tokens' cross-entropy and divides by all ``B * T`` tokens
  (:func:`context_parallel_loss`): the ranks' losses add up to the one-process
  mean. Each rank's mean over its own tokens would make the sum ``P`` times it.
- **Every weight's gradient is summed over the group** (:func:`reduce_gradients`).
  The weights are replicated on every rank and each rank's backward sees only
  the loss of its tokens; ring attention sends the K and V gradients of one
  rank's tokens home to it, so each rank's weight gradients are its tokens'
  share of the whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .placement import sequence_positions
from .ring import ring_attention

__all__ = ["ContextParallelCore", "ContextParallelGPT", "context_parallel_loss", "reduce_gradients"]


class ContextParallelCore:
    """An attention core over the context-parallel group: ``attention(q, k, v, group, ...)``.

    Assigned over :meth:`~ddp_course.models.CausalSelfAttention.attention_core`
    (causal, no dropout), as ``recompute_policies.CheckpointedCore`` is.

    Args:
        attention: :func:`~.ring.ring_attention`, :func:`~.ulysses.allgather_attention`
            or :func:`~.ulysses.ulysses_attention`.
        group: the context-parallel process group (None: the world).
        layout: the placement of the tokens (:func:`~.placement.sequence_segments`).
    """

    def __init__(self, attention: Callable, group=None, layout: str = "zigzag"):
        self.attention, self.group, self.layout = attention, group, layout

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[B, heads, T_local, head_dim]`` each -> this rank's attention output, same shape."""
        return self.attention(q, k, v, group=self.group, causal=True, layout=self.layout)


class ContextParallelGPT(nn.Module):
    """A :class:`~ddp_course.models.TinyGPT` on this rank's tokens of every sequence.

    Input ``int64 [B, T_local]``: this rank's tokens, placed by ``layout``
    (:func:`~.placement.shard_sequence` with ``dim=1``); output their logits
    ``[B, T_local, vocab]``. Every block's attention core becomes a
    :class:`ContextParallelCore` (in place: ``model`` is changed) and the position
    embeddings get the tokens' global positions. Train with
    :func:`context_parallel_loss` and :func:`reduce_gradients`.

    Args:
        model: a TinyGPT whose ``seq_len`` covers the whole sequence, the same
            weights on every rank, without dropout.
        group: the context-parallel process group (None: the world).
        layout: ``"contiguous"`` or ``"zigzag"``.
        attention: how a core attends across ranks (default ring attention).

    Raises:
        ValueError: a model with dropout (the ring's blocks have none).
    """

    def __init__(
        self,
        model: nn.Module,
        group=None,
        layout: str = "zigzag",
        attention: Callable = ring_attention,
    ):
        super().__init__()
        if any(b.attn.dropout for b in model.blocks):
            raise ValueError("context-parallel attention here has no dropout: build with 0")
        self.model, self.group, self.layout = model, group, layout
        for block in model.blocks:
            block.attn.attention_core = ContextParallelCore(attention, group, layout)

    def positions(self, t_local: int) -> torch.Tensor:
        """Global positions (``int64 [T_local]``) of this rank's tokens."""
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        return sequence_positions(rank, size, t_local, self.layout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's logits ``[B, T_local, vocab]`` from its tokens ``int64 [B, T_local]``."""
        return self.model(idx, positions=self.positions(idx.shape[1]).to(idx.device))


def context_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's share of the mean next-token loss over the whole sequence.

    The sum of this rank's token losses over all ``B * T_local * P`` tokens of the
    group: summed over the ranks it is the one-process ``lm_loss``, and its
    gradient, summed over the ranks by :func:`reduce_gradients`, the one-process
    gradient. All-reduce a detached copy (sum) to print the loss.

    Args:
        logits: ``[B, T_local, V]``; targets: ``int64 [B, T_local]``, placed like them.
        group: the context-parallel group (None: the world).
    """
    total = targets.numel() * dist.get_world_size(group)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / total


def reduce_gradients(module: nn.Module, group=None) -> None:
    """Sum every parameter's gradient over the context-parallel group, in place.

    Each rank's backward gives the gradient of its share of the loss
    (:func:`context_parallel_loss`); the shares sum to the whole. One all-reduce
    per parameter (a real job buckets them, or lets FSDP's reduce-scatter over a
    mesh dimension that includes these ranks do it). Parameters without a
    gradient are skipped.
    """
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
