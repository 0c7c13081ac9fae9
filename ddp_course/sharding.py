"""Sharded data parallelism from scratch: ZeRO stages 1, 2 and 3 (lesson 09).

DDP keeps on every rank a full copy of the parameters, the gradients and the
optimizer state. Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020 (https://arxiv.org/abs/1910.02054),
section 5 and Figure 1, split them over the N ranks of the data-parallel group,
one kind of state more at each stage:

- stage 1 (P_os): optimizer state sharded. Gradients are reduce-scattered,
  each rank steps only its shard with its own optimizer state, then the
  parameters are all-gathered.
- stage 2 (P_os+g): gradients sharded too. Each gradient is reduce-scattered
  as soon as autograd has accumulated it and the full gradient is dropped.
- stage 3 (P_os+g+p): parameters sharded too. A layer's parameters are
  all-gathered just before its forward, freed after it, all-gathered again
  just before its backward, and its gradients reduce-scattered.

:func:`state_bytes_per_rank` gives the paper's memory per rank;
:func:`shard_range` the piece of a flat tensor a rank owns; :class:`Zero`
wraps a model and an optimizer class and trains at any stage.

Every parameter is sharded on its own (as FSDP2 does): flattened, padded to a
multiple of N for the collectives, rank r owning elements
``[r * s, min((r + 1) * s, n))`` with ``s = ceil(n / N)``.

On gloo, ``dist.reduce_scatter_tensor`` and ``dist.all_gather_into_tensor``
exist (checked with PyTorch 2.13); ``ReduceOp.AVG`` is not portable across
backends, so gradients are summed and divided by N, as DDP does.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "FP32_ADAM",
    "MIXED_ADAM",
    "BytesPerValue",
    "StateBytes",
    "shard_range",
    "state_bytes_per_rank",
]


@dataclasses.dataclass(frozen=True)
class BytesPerValue:
    """Bytes one parameter costs in each kind of training state.

    Attributes:
        params: bytes of the parameter copy used in forward and backward.
        grads: bytes of its gradient.
        optimizer: bytes of optimizer state (the paper's K), including any
            fp32 master copy of the parameter.
    """

    params: int
    grads: int
    optimizer: int


#: Mixed-precision Adam (ZeRO paper, section 3.1): fp16 parameters and
#: gradients, fp32 master copy + momentum + variance: 2 + 2 + 12 = 16 bytes.
MIXED_ADAM = BytesPerValue(params=2, grads=2, optimizer=12)
#: Plain fp32 Adam: fp32 parameters and gradients, momentum + variance: 4 + 4 + 8.
FP32_ADAM = BytesPerValue(params=4, grads=4, optimizer=8)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of training state one rank holds (floats: the paper divides by N exactly)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        """params + grads + optimizer, in bytes."""
        return self.params + self.grads + self.optimizer


def state_bytes_per_rank(
    stage: int, num_params: int, world_size: int, per_value: BytesPerValue = MIXED_ADAM
) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state per rank (ZeRO paper, section 5).

    With Psi parameters, N ranks and (p, g, K) bytes per value:
    DDP (stage 0) ``(p + g + K) Psi``; stage 1 ``(p + g) Psi + K Psi / N``;
    stage 2 ``p Psi + (g + K) Psi / N``; stage 3 ``(p + g + K) Psi / N``
    (Figure 1 with p = g = 2, K = 12). Activations and buffers are not counted.

    Args:
        stage: 0 (DDP), 1, 2 or 3.
        num_params: Psi, the number of parameters, >= 0.
        world_size: N, the number of data-parallel ranks, >= 1.
        per_value: bytes per value, e.g. :data:`MIXED_ADAM` or :data:`FP32_ADAM`.

    Returns:
        A :class:`StateBytes` in bytes.

    Raises:
        ValueError: stage not in 0..3, num_params < 0 or world_size < 1.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, not {stage}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, not {num_params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    full = (
        num_params * per_value.params,
        num_params * per_value.grads,
        num_params * per_value.optimizer,
    )
    sharded = (stage >= 3, stage >= 2, stage >= 1)  # params, grads, optimizer state
    return StateBytes(*(b / world_size if s else float(b) for b, s in zip(full, sharded)))


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ``[start, end)`` of a flat tensor of ``numel`` elements that ``rank`` owns.

    Every shard has ``s = ceil(numel / world_size)`` slots, so the collectives
    see equal pieces of a buffer padded to ``s * world_size``; the padding
    belongs to no one, so the last shards are shorter and, when
    ``numel < world_size`` or the padding exceeds a shard, empty
    (``start == end``). Concatenating the shards in rank order gives the tensor.

    Args:
        numel: elements of the flat tensor, >= 0.
        rank: 0 <= rank < world_size.
        world_size: number of ranks N, >= 1.

    Returns:
        ``(start, end)`` element offsets, ``0 <= start <= end <= numel``.

    Raises:
        ValueError: numel < 0, world_size < 1 or rank out of range.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, not {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), not {rank}")
    s = math.ceil(numel / world_size)
    return min(rank * s, numel), min((rank + 1) * s, numel)
