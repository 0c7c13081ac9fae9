"""Sequence parallelism and tensor-parallel Transformer blocks from scratch (notebook 13).

Tensor parallelism (Shoeybi et al. 2019, section 3; :mod:`ddp_course.tensor_parallel`)
splits the attention heads and the MLP's hidden features over N ranks, but
leaves the LayerNorms, the dropouts and the residual additions replicated:
every rank stores their whole ``[B, T, d]`` activations. Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022,
section 4.2.2 and figure 5, shard those regions along the sequence instead:
rank r keeps positions ``r T/N .. (r+1) T/N - 1`` (LayerNorm and dropout act
on each position alone, so no communication is needed inside them), and two
new conjugate operators replace Megatron's f and g at the borders:

- g (:func:`gather_from_sequence`), into the tensor-parallel region:
  all-gather along the sequence in forward, reduce-scatter in backward;
- g-bar (:func:`reduce_scatter_to_sequence`), out of it: reduce-scatter
  along the sequence in forward, all-gather in backward.

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so in
forward the bytes on the wire stay those of tensor parallelism (section
4.2.2), while the activations of the LayerNorm and dropout regions shrink N
times.

The column-parallel layers after g need the whole ``[B, T, d]`` input, and
autograd would keep it for their weight gradients: g alone saves the
gathered tensor, N times this rank's shard. Megatron-LM fuses g with the
layer (``LinearWithGradAccumulationAndAsyncCommunication`` with
``sequence_parallel``): forward saves only this rank's shard, and backward
all-gathers it again for the weight gradient (:class:`GatherLinear`). One
more all-gather per column-parallel input in backward buys a block in which
no ``[B, T, d]`` activation is kept: Korthikanti et al.'s sbh·34/t per layer
(section 4.2.2, table 2) instead of TP's sbh(10 + 24/t).

The price: parameters used inside a sharded region (the LayerNorm weights
and biases, the row-parallel biases added after g-bar) are replicated but
each rank sees only its part of the sequence, so each rank's gradient is a
partial sum. :func:`all_reduce_sequence_parallel_grads` adds them over the
tensor-parallel group after backward; forget it and the replicas drift
apart.

Layout: activations are ``[B, T, d]`` (batch first), so the sequence is
dimension 1. :class:`ParallelBlock` turns a whole
:class:`ddp_course.models.Block` into either form;
:class:`ddp_course.parallel_gpt.ParallelGPT` does it for every block of a
:class:`ddp_course.models.TinyGPT`, with the embeddings, final LayerNorm and
head replicated. What a block saves for backward in either form is predicted by
:func:`ddp_course.mesh_predictions.saved_block_bytes_formula`.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from .builtin_collectives import all_gather_single, reduce_scatter_single
from .collectives import group_rank_and_size
from .parallel_rng import ParallelRNG, dropout_masks, region_seed
from .tensor_parallel import ColumnParallelLinear, ParallelAttention, ParallelFeedForward

__all__ = [
    "GatherFromSequence",
    "GatherLinear",
    "ParallelBlock",
    "ReduceScatterToSequence",
    "all_reduce_sequence_parallel_grads",
    "gather_from_sequence",
    "gather_linear",
    "gather_to_replicated",
    "reduce_scatter_to_sequence",
    "dropout_masks",
    "region_seed",
    "scatter_to_sequence",
    "sequence_parallel_parameters",
]

SEQ_DIM = 1  # activations are [B, T, d]
_NEEDS = "sequence parallelism"  # what group_rank_and_size says needs a process group


def _check_seq(seq: int, world_size: int) -> None:
    if seq % world_size:
        raise ValueError(
            f"sequence length {seq} is not divisible by the tensor-parallel world size "
            f"{world_size}: every rank must hold an equal part of the sequence; use a "
            f"sequence length that is a multiple of {world_size}"
        )


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, t, d] on each rank -> [B, N t, d], rank 0's positions first."""
    _, n = group_rank_and_size(group, _NEEDS)
    # Ranks' tensors stacked along dimension 0: [N B, t, d], seen as [N, B, t, d].
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out.unflatten(0, (n, -1)).movedim(0, SEQ_DIM).flatten(SEQ_DIM, SEQ_DIM + 1)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, T, d] partial sums on each rank -> this rank's [B, T/N, d] of their sum."""
    _, n = group_rank_and_size(group, _NEEDS)
    _check_seq(x.shape[SEQ_DIM], n)
    parts = x.unflatten(SEQ_DIM, (n, -1)).movedim(SEQ_DIM, 0).contiguous()  # [N, B, t, d]
    out = x.new_empty(parts.shape[1:])
    reduce_scatter_single(out, parts.flatten(0, 1), group=group)  # rank r: the sum of parts[r]
    return out


def _my_part(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    rank, n = group_rank_and_size(group, _NEEDS)
    _check_seq(x.shape[SEQ_DIM], n)
    return x.chunk(n, SEQ_DIM)[rank].contiguous()


class GatherFromSequence(torch.autograd.Function):
    """Korthikanti et al.'s g: all-gather along the sequence forward, reduce-scatter backward.

    Entering the tensor-parallel region: each rank holds ``[B, T/N, d]`` of a
    LayerNorm's output and the column-parallel layers need the whole
    ``[B, T, d]``. Each rank's gradient of the whole sequence is only its
    heads' or hidden features' contribution, so backward sums the N
    gradients and keeps this rank's positions: a reduce-scatter.
    Korthikanti et al. 2022, section 4.2.2, figure 5.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Korthikanti et al.'s g-bar: reduce-scatter along the sequence forward, all-gather backward.

    Leaving the tensor-parallel region: each rank holds a partial sum
    ``[B, T, d]`` (row-parallel output); the sharded region needs this rank's
    positions of the sum, ``[B, T/N, d]``. Backward: each rank holds the
    gradient of its positions only, and every rank's partial sum needs the
    gradient of all positions: an all-gather. Section 4.2.2, figure 5.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_seq(grad, ctx.group), None


class _Conjugate(torch.autograd.Function):
    """``forward(x, group)`` forward, ``backward(grad, group)`` backward: g's pattern, any pair."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, forward, backward):
        ctx.group, ctx.backward = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward(grad, ctx.group), None, None, None


def gather_from_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """g: ``[B, T/N, d]`` -> ``[B, T, d]`` (all-gather); backward reduce-scatters.

    Raises:
        RuntimeError: no process group has been created.
    """
    group_rank_and_size(group, _NEEDS)
    return GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """g-bar: partial sums ``[B, T, d]`` -> this rank's ``[B, T/N, d]`` of the sum.

    Backward all-gathers the gradient along the sequence.

    Raises:
        ValueError: T not divisible by the world size.
        RuntimeError: no process group has been created.
    """
    _check_seq(x.shape[SEQ_DIM], group_rank_and_size(group, _NEEDS)[1])
    return ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A replicated ``[B, T, d]`` -> this rank's ``[B, T/N, d]`` (a slice, no communication).

    Backward all-gathers the gradient, so the replicated producer (the
    embeddings) receives the gradient of every position on every rank.
    Megatron-LM's ``scatter_to_sequence_parallel_region``.

    Raises:
        ValueError: T not divisible by the world size.
        RuntimeError: no process group has been created.
    """
    _check_seq(x.shape[SEQ_DIM], group_rank_and_size(group, _NEEDS)[1])
    return _Conjugate.apply(x, group, _my_part, _all_gather_seq)


def gather_to_replicated(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's ``[B, T/N, d]`` -> the replicated ``[B, T, d]`` (all-gather).

    For leaving sequence parallelism into replicated layers (the final
    LayerNorm and head), which compute the same gradient on every rank:
    backward keeps this rank's positions, no communication.

    Raises:
        RuntimeError: no process group has been created.
    """
    group_rank_and_size(group, _NEEDS)
    return _Conjugate.apply(x, group, _all_gather_seq, _my_part)


class GatherLinear(torch.autograd.Function):
    """g fused with the column-parallel layers after it; only the sequence shard is saved.

    Forward: all-gather this rank's ``x`` ``[B, T/N, d]`` along the sequence
    into ``[B, T, d]`` and apply each column-parallel shard to it:
    ``linear(x_full, W_i, b_i)``, ``[B, T, out_i]``. Only ``x`` and the weights
    are saved. Backward: all-gather ``x`` again (the weight gradient
    ``dL/dW_i = dY_i^T x_full`` needs every position), sum the input
    gradients of the layers ``dY_i W_i`` and reduce-scatter that sum (one
    reduce-scatter for all layers, as one g). Megatron-LM,
    ``LinearWithGradAccumulationAndAsyncCommunication`` with
    ``sequence_parallel=True`` (Korthikanti et al. 2022, section 4.2.2),
    without its overlap of the re-gather with the input-gradient matmul.

    Call it through :func:`gather_linear`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        full = _all_gather_seq(x, group)
        ctx.save_for_backward(x, *weights)  # the shard: N times smaller than full
        return tuple(functional.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.group).flatten(0, -2)  # again, [B T, d]
        grad_full = sum(g @ w for g, w in zip(grads, weights))  # [B, T, d]
        out = [_reduce_scatter_seq(grad_full, ctx.group), None]
        for g, has_bias in zip(grads, ctx.has_bias):
            g = g.flatten(0, -2)  # [B T, out_i]
            out += [g.transpose(0, 1) @ full, g.sum(0) if has_bias else None]
        return tuple(out)


def gather_linear(
    x: torch.Tensor,
    layers: list[ColumnParallelLinear],
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, ...]:
    """g, then each column-parallel layer: ``[B, T/N, d]`` -> ``[B, T, out_i/N]`` each.

    The layers' forward is not called (it would apply f): their shards'
    weights and biases are. Saves only ``x`` for backward (:class:`GatherLinear`).

    Raises:
        RuntimeError: no process group has been created.
    """
    group_rank_and_size(group, _NEEDS)
    params = [t for layer in layers for t in (layer.weight, layer.bias)]
    return GatherLinear.apply(x, group, *params)


class ParallelBlock(nn.Module):
    """A pre-LayerNorm Transformer block split over N tensor-parallel ranks.

    Built from a whole :class:`ddp_course.models.Block` (weights copied):
    :class:`ParallelAttention` and :class:`ParallelFeedForward` hold 1/N of
    the heads and hidden features; ``ln1``, ``ln2`` and the biases of the
    row-parallel layers are replicated.

    - ``sequence_parallel=False`` (Shoeybi et al. 2019, section 3): input and
      output ``[B, T, d]``, equal on every rank; per call 2 all-reduces of
      ``[B, T, d]`` forward (g after attention and MLP) and 2 backward (f).
    - ``sequence_parallel=True`` (Korthikanti et al. 2022, section 4.2.2,
      figure 5): input and output this rank's ``[B, T/N, d]``; LayerNorms,
      dropouts and residual additions act on it; per call 2 all-gathers (g,
      fused with q/k/v and with fc1: :class:`GatherLinear`) and 2
      reduce-scatters (g-bar) of ``[B, T, d]`` forward; backward 2
      reduce-scatters (g), 2 all-gathers (g-bar) and 2 all-gathers that
      rebuild the inputs of q/k/v and fc1 for their weight gradients. After
      backward, call :func:`all_reduce_sequence_parallel_grads`.

    Dropout on this rank's heads, and under sequence parallelism on its
    positions, draws from ``rng`` (:class:`ParallelRNG`, different on every
    rank); dropout on a replicated ``[B, T, d]`` from the default generator.

    Args:
        block: the whole block.
        rank: this rank in the tensor-parallel group.
        world_size: number of tensor-parallel ranks N.
        group: the tensor-parallel process group (default: the whole job).
        sequence_parallel: shard the LayerNorm and dropout regions along T.
        rng: the sharded regions' random state, one per model (default: a
            new ``ParallelRNG(rank=rank)``).

    Raises:
        ValueError: heads or hidden features not divisible by N (here), or
            T not divisible by N (in forward, with sequence parallelism).
    """

    def __init__(
        self,
        block: nn.Module,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng: ParallelRNG | None = None,
    ):
        super().__init__()
        self.sequence_parallel, self.group = sequence_parallel, group
        self.world_size = world_size
        self.ln1 = copy.deepcopy(block.ln1)
        self.attn = ParallelAttention(block.attn, rank, world_size, group, rng)
        self.ln2 = copy.deepcopy(block.ln2)
        self.mlp = ParallelFeedForward(block.mlp, rank, world_size, group)
        self.drop = copy.deepcopy(block.drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel or self.world_size == 1:
            x = x + self.attn(self.ln1(x))
            return x + self.drop(self.mlp(self.ln2(x)))
        attn, mlp = self.attn, self.mlp
        # g fused with q, k, v: [B, T/N, d] in, only that shard saved for backward.
        q, k, v = gather_linear(self.ln1(x), [attn.q, attn.k, attn.v], self.group)
        h = reduce_scatter_to_sequence(attn.heads_partial_sum(q, k, v), self.group)  # g-bar
        with attn.sharded_rng(x.device):  # this rank's positions: masks differ across ranks
            x = x + attn.drop(h + attn.proj.bias)
        (h,) = gather_linear(self.ln2(x), [mlp.fc1], self.group)
        h = functional.linear(mlp.act(h), mlp.fc2.weight)
        h = reduce_scatter_to_sequence(h, self.group)
        with attn.sharded_rng(x.device):
            return x + self.drop(h + mlp.fc2.bias)


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The replicated parameters that act on a sequence shard, in a fixed order.

    In every :class:`ParallelBlock` with sequence parallelism: ``ln1``,
    ``ln2`` (weight and bias) and the biases of ``attn.proj`` and
    ``mlp.fc2`` (added after g-bar): 6 d numbers per block. Their gradients
    on one rank cover only its positions.
    """
    params = []
    for sub in module.modules():
        if isinstance(sub, ParallelBlock) and sub.sequence_parallel and sub.world_size > 1:
            params += [*sub.ln1.parameters(), *sub.ln2.parameters()]
            params += [sub.attn.proj.bias, sub.mlp.fc2.bias]
    return params


def all_reduce_sequence_parallel_grads(
    module: nn.Module, group: dist.ProcessGroup | None = None
) -> int:
    """Sum the gradients of :func:`sequence_parallel_parameters` over ``group``.

    One all-reduce of all of them flattened together (as Megatron-LM's
    ``allreduce_sequence_parallel_grads`` does); call it after backward and
    before the optimizer step, on every rank of the tensor-parallel group.

    Returns:
        The number of elements reduced (0: nothing to do, no communication).

    Raises:
        ValueError: a parameter has no gradient (backward has not run).
    """
    params = sequence_parallel_parameters(module)
    if not params:
        return 0
    if any(p.grad is None for p in params):
        raise ValueError("a sequence-parallel parameter has no gradient: run backward first")
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    return flat.numel()
