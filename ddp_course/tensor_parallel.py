"""Tensor parallelism from scratch: Megatron-LM's MLP (notebook 08) and attention (13).

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", 2019, section 3, split one MLP block
``Y = act(X A) B`` over N ranks without splitting the batch:

- the first weight ``A`` by its output features (columns of ``A``, rows of
  ``nn.Linear.weight``): rank r computes ``act(X A_r)``, its own slice of the
  hidden features, with no communication, because the activation acts on
  each feature alone (:class:`ColumnParallelLinear`);
- the second weight ``B`` by its input features: rank r multiplies its
  hidden slice by ``B_r`` and gets a partial sum of the output; one
  all-reduce adds the N partial sums (:class:`RowParallelLinear`), then the
  bias is added once.

Two *conjugate* operators place the communication (the paper's f and g):

- f (:func:`copy_to_parallel`), before the column-parallel layer: identity
  in forward (every rank already holds the whole input ``X``), all-reduce in
  backward (each rank holds only its slice's contribution to ``dL/dX``);
- g (:func:`reduce_from_parallel`), after the row-parallel layer: all-reduce
  in forward, identity in backward (the gradient of a sum reaches every
  term unchanged).

So a block costs one all-reduce of the block's output ``[B, d]`` in forward
and one of its input gradient ``[B, d]`` in backward, whatever N is, while
each rank stores and multiplies 1/N of the weights. :class:`ParallelFeedForward`
builds the block from a whole :class:`ddp_course.models.FeedForward`, so a test
can compare every output and gradient with the single-process block.

Attention splits the same way, by heads (section 3, figure 3(b)):
:class:`ParallelAttention` keeps whole heads of column-parallel Q, K and V on
each rank and a row-parallel output projection, with f once before and g
once after (notebook 13). Sequence parallelism, which also shards the
LayerNorm and dropout regions, is :mod:`ddp_course.sequence_parallel`.

Random numbers: dropout on a rank's own heads must draw a different mask on
every rank, dropout on a replicated tensor the same mask. :class:`ParallelRNG`
keeps a second generator state per rank for the first, the global generator
(seeded alike on every rank) serves the second, as Megatron-LM's
``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` do.

PyTorch ships the same split as ``ColwiseParallel`` / ``RowwiseParallel``
plans for ``torch.distributed.tensor.parallel.parallelize_module``
(https://pytorch.org/docs/stable/distributed.tensor.parallel.html).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from .collectives import group_rank_and_size
from .models import FeedForward, causal_attention
from .parallel_rng import ParallelRNG, region_seed
from .partition import check_rank, partition

__all__ = [
    "ColumnParallelLinear",
    "CopyToParallel",
    "ParallelAttention",
    "ParallelFeedForward",
    "ParallelRNG",
    "ReduceFromParallel",
    "RowParallelLinear",
    "copy_to_parallel",
    "gather_shards",
    "reduce_from_parallel",
    "region_seed",
]


def _all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    # A copy: autograd's input (forward) or incoming gradient (backward) must not change
    # in place; contiguous because collectives need one flat buffer.
    out = tensor.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class CopyToParallel(torch.autograd.Function):
    """Megatron-LM's operator f: identity in forward, all-reduce (sum) in backward.

    Placed where a replicated tensor enters the column-parallel part of a
    block. Forward returns the input itself (every rank holds the same
    ``X``); backward sums the gradients of the N ranks, since rank r's
    gradient only holds what flowed through its own shard of the weights.
    Shoeybi et al. 2019, section 3, figure 3(a).

    Shapes and dtypes: any tensor; output and gradient have the input's
    shape and dtype. Call it through :func:`copy_to_parallel`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new autograd node, same storage: no copy, no communication

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce_sum(grad, ctx.group), None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron-LM's operator g: all-reduce (sum) in forward, identity in backward.

    Placed after the row-parallel layer: each rank holds a partial sum of
    the output, and the all-reduce makes the whole output on every rank.
    The output is a plain sum of the inputs, so the gradient reaching each
    term is the output's gradient, already equal on every rank: no
    communication in backward. Shoeybi et al. 2019, section 3, figure 3(a).

    Shapes and dtypes: any tensor; the output has the input's shape and
    dtype. Call it through :func:`reduce_from_parallel`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_parallel(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Apply f (identity forward, all-reduce backward) over ``group``.

    Args:
        x: the replicated input, any shape and floating dtype, equal on
            every rank of ``group``.
        group: the tensor-parallel process group (default: the whole job).

    Returns:
        ``x`` unchanged, wired so that its gradient is summed over ``group``.

    Raises:
        RuntimeError: no process group has been created.
    """
    group_rank_and_size(group, "tensor parallelism with more than one rank")
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Apply g (all-reduce forward, identity backward) over ``group``.

    Args:
        x: this rank's partial sum, any shape and floating dtype.
        group: the tensor-parallel process group (default: the whole job).

    Returns:
        The sum of ``x`` over the ranks of ``group``, same shape and dtype.

    Raises:
        RuntimeError: no process group has been created.
    """
    group_rank_and_size(group, "tensor parallelism with more than one rank")
    return ReduceFromParallel.apply(x, group)


class _ShardedLinear(nn.Module):
    """One rank's shard of a whole ``nn.Linear``, split along the weight's ``split_dim``.

    What :class:`ColumnParallelLinear` (``split_dim = 0``) and
    :class:`RowParallelLinear` (``split_dim = 1``) share; their docstrings give
    the arguments.
    """

    split_dim: int

    def __init__(
        self,
        full: nn.Linear,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        check_rank(rank, world_size)
        name = ("out_features", "in_features")[self.split_dim]
        start, stop = partition(full.weight.shape[self.split_dim], world_size, "even", name)[rank]
        group_rank_and_size(group, expected=(rank, world_size))
        self.in_features, self.out_features = full.in_features, full.out_features
        self.rank, self.world_size, self.group = rank, world_size, group
        weight = full.weight.detach().narrow(self.split_dim, start, stop - start)
        self.weight = nn.Parameter(weight.clone())
        bias = full.bias
        if bias is not None and self.split_dim == 0:
            bias = bias[start:stop]  # a row-parallel layer adds its whole bias once, after g
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())


class ColumnParallelLinear(_ShardedLinear):
    """A linear layer whose output features are split over ranks (Megatron-LM's ``A``).

    Rank r keeps rows ``partition(out_features, N, "even")[r]`` of the whole
    layer's ``weight`` (shape ``[out/N, in]``) and the same slice of its
    bias. Forward applies f (:func:`copy_to_parallel`) to the replicated
    input, then its shard: input ``[*, in]``, output ``[*, out/N]``, this
    rank's slice of the whole layer's output. No communication in forward;
    one all-reduce of ``dL/dX`` (``[*, in]``) in backward.

    Args:
        full: the whole layer, ``weight [out, in]``, optional ``bias [out]``;
            its values are copied, not shared.
        rank: this rank in the tensor-parallel group.
        world_size: number of tensor-parallel ranks N.
        group: the tensor-parallel process group (default: the whole job).

    Raises:
        ValueError: ``out_features`` not divisible by N, or rank and
            world_size not those of the process group.
    """

    split_dim = 0  # rows of the weight: output features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear expects the whole input, [*, {self.in_features}], "
                f"got {list(x.shape)}"
            )
        if self.world_size > 1:
            x = copy_to_parallel(x, self.group)
        return functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(this shard: {self.weight.shape[0]}), rank={self.rank}/{self.world_size}"
        )


class RowParallelLinear(_ShardedLinear):
    """A linear layer whose input features are split over ranks (Megatron-LM's ``B``).

    Rank r keeps columns ``partition(in_features, N, "even")[r]`` of the whole
    layer's ``weight`` (shape ``[out, in/N]``) and the whole bias. Forward
    takes this rank's slice of the input, ``[*, in/N]`` (the output of a
    :class:`ColumnParallelLinear`), computes a partial sum ``[*, out]``,
    applies g (:func:`reduce_from_parallel`: one all-reduce) and only then
    adds the bias, so it is counted once and not N times. Output ``[*, out]``,
    the whole layer's output, equal on every rank. No communication in
    backward; the bias gradient is the same on every rank.

    Args:
        full, rank, world_size, group: as :class:`ColumnParallelLinear`.

    Raises:
        ValueError: ``in_features`` not divisible by N, or rank and
            world_size not those of the process group.
    """

    split_dim = 1  # columns of the weight: input features

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        if x_shard.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"RowParallelLinear expects this rank's slice of the input, "
                f"[*, {self.weight.shape[1]}] = [*, in_features / world_size], "
                f"got {list(x_shard.shape)}"
            )
        partial = functional.linear(x_shard, self.weight)
        out = reduce_from_parallel(partial, self.group) if self.world_size > 1 else partial
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (this shard: {self.weight.shape[1]}), "
            f"out_features={self.out_features}, rank={self.rank}/{self.world_size}"
        )


class ParallelFeedForward(nn.Module):
    """:class:`FeedForward` split over N ranks: column-parallel fc1, activation, row-parallel fc2.

    Input ``[*, d_model]``, equal on every rank; output ``[*, d_model]``,
    equal on every rank and to the whole MLP's. Each rank holds
    ``hidden/N`` of the hidden features: fc1 weight ``[hidden/N, d_model]``,
    fc2 weight ``[d_model, hidden/N]``, so 1/N of the weights apart from
    fc2's bias. Communication per call: one all-reduce of ``[*, d_model]``
    in forward (g) and one in backward (f, when the input needs a
    gradient, as inside a network). Shoeybi et al. 2019, section 3.

    Args:
        mlp: the whole block; its weights are copied.
        rank: this rank in the tensor-parallel group.
        world_size: number of tensor-parallel ranks N.
        group: the tensor-parallel process group (default: the whole job).

    Raises:
        ValueError: the hidden size is not divisible by N, or rank and
            world_size are not those of the process group.
    """

    def __init__(
        self,
        mlp: FeedForward,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        partition(mlp.fc1.out_features, world_size, "even", "hidden")  # the error names it
        self.fc1 = ColumnParallelLinear(mlp.fc1, rank, world_size, group)
        self.act = mlp.act
        self.fc2 = RowParallelLinear(mlp.fc2, rank, world_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, no communication and no fc2 bias.

        Input ``[*, d_model]`` (whole), output ``[*, d_model]``: the sum of
        the N ranks' partial sums plus ``fc2.bias`` is the MLP's output. A
        sequence-parallel block reduce-scatters it instead of all-reducing it
        (:mod:`ddp_course.sequence_parallel`).
        """
        hidden = self.act(functional.linear(x, self.fc1.weight, self.fc1.bias))
        return functional.linear(hidden, self.fc2.weight)


class ParallelAttention(nn.Module):
    """Causal self-attention with its heads split over N ranks (Megatron-LM, attention).

    Shoeybi et al. 2019, section 3, figure 3(b): Q, K and V are
    column-parallel, so rank r computes heads ``r a/N .. (r+1) a/N - 1``
    whole (attention of one head needs no other head); the output
    projection is row-parallel and its partial sums are added by one
    all-reduce. f comes once before Q, K and V together, g once after the
    projection: one all-reduce of ``[B, T, d]`` in forward and one in
    backward per attention, whatever N is.

    Built from a whole :class:`ddp_course.models.CausalSelfAttention`
    (weights copied): ``q``, ``k``, ``v`` are :class:`ColumnParallelLinear`
    shards ``[d/N, d]``, ``proj`` a :class:`RowParallelLinear` shard
    ``[d, d/N]`` with the whole bias. Input and output ``[B, T, d]``, equal on
    every rank, in the weights' dtype. Attention-weight dropout acts on this
    rank's heads: it draws from ``rng`` (:class:`ParallelRNG`), different on
    every rank; the output dropout acts on the replicated output: it draws
    from the default generator, the same on every rank.

    Args:
        attn: the whole attention module.
        rank: this rank in the tensor-parallel group.
        world_size: number of tensor-parallel ranks N.
        group: the tensor-parallel process group (default: the whole job).
        rng: the sharded regions' random state, shared by every module of one
            model (default: a new ``ParallelRNG(rank=rank)``).

    Raises:
        ValueError: the number of heads is not divisible by N, or rank and
            world_size are not those of the process group.
    """

    def __init__(
        self,
        attn: nn.Module,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        rng: ParallelRNG | None = None,
    ):
        super().__init__()
        heads = attn.q.out_features // attn.head_dim
        if heads % world_size:
            raise ValueError(
                f"n_heads={heads} is not divisible by the tensor-parallel world size "
                f"{world_size}: every rank must hold whole heads; use a number of heads that "
                f"is a multiple of {world_size} or another number of ranks"
            )
        self.rank, self.world_size, self.group = rank, world_size, group
        self.head_dim, self.dropout, self.flash = attn.head_dim, attn.dropout, attn.flash
        self.q = ColumnParallelLinear(attn.q, rank, world_size, group)
        self.k = ColumnParallelLinear(attn.k, rank, world_size, group)
        self.v = ColumnParallelLinear(attn.v, rank, world_size, group)
        self.proj = RowParallelLinear(attn.proj, rank, world_size, group)
        self.drop = nn.Dropout(attn.dropout)
        self.rng = ParallelRNG(rank=rank) if rng is None else rng

    def sharded_rng(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Where dropout acts on this rank's own part: :meth:`ParallelRNG.fork`
        with more than one rank; the default generator with one (the plain module)."""
        return self.rng.fork(device) if self.world_size > 1 else contextlib.nullcontext()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        return x.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads, projected: ``[B, T, d]`` in, partial sum ``[B, T, d]`` out.

        No communication and no projection bias: the N ranks' partial sums
        plus ``proj.bias`` are the whole attention's output before dropout.
        """
        # The shards' weights, not the layers' forward: each ColumnParallelLinear
        # would apply f itself, three all-reduces in backward where one suffices.
        q = functional.linear(x, self.q.weight, self.q.bias)
        k = functional.linear(x, self.k.weight, self.k.bias)
        v = functional.linear(x, self.v.weight, self.v.bias)
        return self.heads_partial_sum(q, k, v)

    def heads_partial_sum(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Attention of this rank's heads from their q, k, v ``[B, T, d/N]``, projected:
        the partial sum ``[B, T, d]`` (no projection bias), as :meth:`partial_sum`."""
        batch, seq = q.shape[:2]
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        p = self.dropout if self.training else 0.0
        # This rank's heads: their dropout masks must differ from the other ranks'.
        rng = self.sharded_rng(q.device) if p > 0 else None
        y = causal_attention(q, k, v, p, self.flash, rng)
        return functional.linear(y.transpose(1, 2).reshape(batch, seq, -1), self.proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.q.in_features:
            raise ValueError(
                f"ParallelAttention expects the whole input [B, T, {self.q.in_features}], "
                f"got {list(x.shape)}"
            )
        if self.world_size > 1:
            x = copy_to_parallel(x, self.group)  # f
        out = self.partial_sum(x)
        if self.world_size > 1:
            out = reduce_from_parallel(out, self.group)  # g
        return self.drop(out + self.proj.bias)  # the bias once, after the sum

    def extra_repr(self) -> str:
        heads = self.q.weight.shape[0] // self.head_dim
        return f"heads on this rank={heads}, rank={self.rank}/{self.world_size}"


def gather_shards(
    shard: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``shard`` along ``dim``, rank 0 first (``all_gather``).

    Rebuilds a whole weight or gradient from its shards, e.g.
    ``gather_shards(col.weight.grad, 0)`` for a :class:`ColumnParallelLinear`
    and ``gather_shards(row.weight.grad, 1)`` for a :class:`RowParallelLinear`.

    Args:
        shard: this rank's tensor; same shape and dtype on every rank.
        dim: the dimension that was split.
        group: the process group (default: the whole job).

    Returns:
        A tensor N times larger along ``dim``, equal on every rank.

    Raises:
        RuntimeError: no process group has been created.
    """
    group_rank_and_size(group, "tensor parallelism with more than one rank")
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
