"""A whole TinyGPT split over tensor-parallel ranks, and gathered back whole (notebook 13).

:class:`ParallelGPT` builds, from a whole :class:`ddp_course.models.TinyGPT`,
the same model with every block a :class:`ddp_course.sequence_parallel.ParallelBlock`
(Megatron-LM's tensor parallelism, optionally with Korthikanti et al.'s sequence
parallelism), the embeddings, final LayerNorm and head replicated.
:func:`gather_full_state` gathers every sharded parameter or gradient of such a
model back into the whole model's shapes and names, so a test compares it with
the single-process model key by key.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .parallel_rng import ParallelRNG
from .sequence_parallel import ParallelBlock, gather_to_replicated, scatter_to_sequence
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, gather_shards

__all__ = ["ParallelGPT", "gather_full_state"]


class ParallelGPT(nn.Module):
    """:class:`ddp_course.models.TinyGPT` with every block a :class:`ParallelBlock`.

    Token and position embeddings, the final LayerNorm and the head stay
    replicated (whole on every rank; their gradients come out equal on every
    rank, no communication). With ``sequence_parallel=True`` the embeddings'
    output is split along T before the first block
    (:func:`scatter_to_sequence`) and gathered after the last
    (:func:`gather_to_replicated`). Input ``int64 [B, T]``, equal on every
    rank; output logits ``[B, T, V]``, equal on every rank. Parameter names
    are TinyGPT's, so :func:`gather_full_state` compares with it key by key.
    Every block draws its sharded regions' dropout from one ``rng``
    (:class:`ParallelRNG`; default ``ParallelRNG(rank=rank)``, seeded from
    the default generator's seed), the embeddings' dropout (replicated) from
    the default generator.

    Raises:
        ValueError: as :class:`ParallelBlock`; an input longer than ``seq_len``.
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng: ParallelRNG | None = None,
    ):
        super().__init__()
        self.seq_len, self.group = model.seq_len, group
        self.rng = ParallelRNG(rank=rank) if rng is None else rng
        self.sequence_parallel = sequence_parallel and world_size > 1
        self.tok_emb, self.pos_emb = copy.deepcopy(model.tok_emb), copy.deepcopy(model.pos_emb)
        self.drop = copy.deepcopy(model.drop)
        self.blocks = nn.ModuleList(
            ParallelBlock(b, rank, world_size, group, sequence_parallel, self.rng)
            for b in model.blocks
        )
        self.ln_f, self.head = copy.deepcopy(model.ln_f), copy.deepcopy(model.head)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.seq_len:
            raise ValueError(f"input of {seq} tokens is longer than seq_len={self.seq_len}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(seq, device=idx.device)))
        if self.sequence_parallel:
            x = scatter_to_sequence(x, self.group)
        for block in self.blocks:
            x = block(x)
        if self.sequence_parallel:
            x = gather_to_replicated(x, self.group)
        return self.head(self.ln_f(x))


def gather_full_state(
    module: nn.Module, group: dist.ProcessGroup | None = None, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of a tensor-parallel module, whole, named as in one process.

    Column-parallel weights and biases are gathered along dimension 0,
    row-parallel weights along dimension 1 (:func:`gather_shards`);
    everything else is this rank's replica, detached. A collective: call it
    on every rank of ``group``.

    Args:
        module: a :class:`ParallelBlock`, :class:`ParallelGPT` or any module
            holding column- and row-parallel layers.
        group: the tensor-parallel process group.
        grads: gather ``.grad`` instead of the values.

    Returns:
        ``{name: tensor}`` with the shapes of the whole model's parameters.

    Raises:
        ValueError: ``grads=True`` and a parameter has no gradient.
    """

    def value(p: nn.Parameter) -> torch.Tensor:
        if grads and p.grad is None:
            raise ValueError("a parameter has no gradient: run backward first")
        return (p.grad if grads else p).detach()

    full = {name: value(p) for name, p in module.named_parameters()}
    for prefix, sub in module.named_modules():
        if isinstance(sub, ColumnParallelLinear) and sub.world_size > 1:
            full[f"{prefix}.weight"] = gather_shards(value(sub.weight), 0, group)
            if sub.bias is not None:
                full[f"{prefix}.bias"] = gather_shards(value(sub.bias), 0, group)
        elif isinstance(sub, RowParallelLinear) and sub.world_size > 1:
            full[f"{prefix}.weight"] = gather_shards(value(sub.weight), 1, group)
    return full
