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
:func:`ddp_course.partition.partition` (``"padded"``) the piece of a flat tensor a
rank owns; :class:`ZeRO`
wraps a model and an optimizer class and trains at any stage, logging its collectives
in a :class:`CommLog`. The bytes a rank really holds and its collectives really
moved, which check both, are counted by :mod:`ddp_course.tools.zero_counts`.

Every parameter is sharded on its own, as FSDP2 does, but cut differently:
flattened, padded to a multiple of N for the collectives, rank r owning elements
``[r * s, min((r + 1) * s, n))`` with ``s = ceil(n / N)``. FSDP2 keeps the shape
and cuts dim 0 instead (rank r owns rows ``[r * t, (r + 1) * t)``, ``t = ceil(rows / N)``),
so its shards are whole rows and ours may end inside a row.

Gloo implements both collectives used here on CPU tensors (checked with
PyTorch 2.13): ``dist.reduce_scatter_single`` and ``dist.all_gather_single``
(``reduce_scatter_tensor`` and ``all_gather_into_tensor`` before 2.13), so no
emulation with all-reduce is needed. ``ReduceOp.AVG`` is not portable across
backends, so gradients are summed and divided by N, as DDP does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .builtin_collectives import all_gather_single, reduce_scatter_single
from .ddp import broadcast_state, check_same_shapes
from .partition import check_rank, partition
from .runtime import require_group

__all__ = [
    "FP32_ADAM",
    "FP32_SGD",
    "MIXED_ADAM",
    "BytesPerValue",
    "CommLog",
    "StateBytes",
    "ZeRO",
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
#: Plain fp32 SGD without momentum: fp32 parameters and gradients, no optimizer state.
FP32_SGD = BytesPerValue(params=4, grads=4, optimizer=0)


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


@dataclasses.dataclass
class CommLog:
    """Collectives one rank called, in the paper's units (section 7).

    A reduce-scatter or an all-gather of a tensor of ``b`` bytes moves ``b``
    (each rank sends ``(N - 1) / N`` of it in a ring), an all-reduce ``2 b``
    (a reduce-scatter then an all-gather). Padding added to make the shards
    equal is left out, so the volume depends only on the model.

    Attributes:
        calls: ``(op, bytes)`` in call order, op in {"reduce_scatter", "all_gather"}.
    """

    calls: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @property
    def volume_bytes(self) -> int:
        """Sum of the bytes of every collective's full (unsharded) tensor."""
        return sum(b for _, b in self.calls)

    def clear(self) -> None:
        """Forget the calls logged so far (e.g. at the start of a step)."""
        self.calls.clear()


class _Sharded:
    """One parameter's shard on this rank: the values this rank's optimizer steps.

    ``shard`` is a 1-D ``nn.Parameter`` of ``end - start`` elements (possibly
    none), the parameter's dtype, ``[start, end)`` of the flattened parameter.
    """

    def __init__(self, param: nn.Parameter, rank: int, world_size: int, own_storage: bool):
        self.param = param
        self.numel = param.numel()
        self.shape = param.shape
        check_rank(rank, world_size)
        self.start, self.end = partition(self.numel, world_size, "padded")[rank]
        self.slot = math.ceil(self.numel / world_size)  # shard size in the padded buffer
        flat = param.detach().view(-1)[self.start : self.end]
        # Stages 1 and 2 step a view of the full parameter in place; stage 3
        # frees the full parameter, so its shard must own its storage.
        self.shard = nn.Parameter(flat.clone() if own_storage else flat)


class ZeRO(nn.Module):
    """ZeRO stage 1, 2 or 3 data parallelism around ``module``, with its own optimizer.

    Like ``torch.distributed.optim.ZeroRedundancyOptimizer`` it takes the
    optimizer *class*: the optimizer is built on this rank's shards only, so
    its state (Adam: momentum and variance) exists for 1/N of every
    parameter. The training loop is the usual one::

        zero = ZeRO(model, torch.optim.Adam, stage=2, lr=1e-3)
        loss_fn(zero(x), y).backward()
        zero.step()       # stage 1: reduce-scatter gradients; all stages: step the shards
        zero.zero_grad()

    - stage 1: after backward every rank holds full gradients; :meth:`step`
      reduce-scatters each one (sum, then / N), steps the shards and
      all-gathers the parameters.
    - stage 2: a post-accumulate-grad hook reduce-scatters each gradient the
      moment autograd has written it and drops the full gradient.
    - stage 3: the full parameters are empty outside of use. A forward
      pre-hook on each module that owns parameters all-gathers them, a forward
      hook frees them and hooks its outputs' gradients to all-gather them
      again before the module's backward; the gradient hook reduce-scatters
      and frees.

    Rank 0's parameters and buffers are broadcast at construction. Every
    parameter must be used exactly once per forward (no tied weights), by the
    module that owns it, which returns a tensor or a tuple of tensors; every
    rank must run forward and backward the same number of times. A rank
    whose shard of a small parameter is empty still joins every collective.

    Args:
        module: the model, on this rank's device, same on every rank.
        optimizer_class: e.g. ``torch.optim.Adam``; called as
            ``optimizer_class(shards, **defaults)``.
        stage: 1, 2 or 3.
        group: process group (default: the world).
        **defaults: the optimizer's arguments (``lr=...``).

    Attributes:
        module: the wrapped model.
        optimizer: the optimizer over this rank's shards.
        comm: a :class:`CommLog` of every collective since the last ``comm.clear()``.
        peak_gathered_bytes: stage 3: the most bytes of full parameters that
            were all-gathered at the same time (set it to 0 to start again).

    Raises:
        RuntimeError: no process group.
        ValueError: stage not in 1..3, or parameters differ in name, shape or
            dtype across ranks.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        stage: int,
        group: Any = None,
        **defaults: Any,
    ):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3 (stage 0 is plain DDP), not {stage}")
        self.group = require_group(group, "ZeRO")
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.stage = stage
        self.module = module
        self.comm = CommLog()
        self.peak_gathered_bytes = 0
        check_same_shapes(module, self.group)
        broadcast_state(module, self.group)
        self._shards = {
            p: _Sharded(p, self.rank, self.world_size, own_storage=stage == 3)
            for p in module.parameters()
            if p.requires_grad
        }
        self.optimizer = optimizer_class([s.shard for s in self._shards.values()], **defaults)
        if stage >= 2:
            for p in self._shards:
                p.register_post_accumulate_grad_hook(self._reduce_grad_hook)
        if stage == 3:
            for sub in module.modules():
                if any(p in self._shards for p in sub.parameters(recurse=False)):
                    sub.register_forward_pre_hook(self._before_forward)
                    sub.register_forward_hook(self._after_forward)
            for p in self._shards:
                self._free(p)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # -- collectives, logged -------------------------------------------------

    def _all_gather(self, sharded: _Sharded) -> torch.Tensor:
        """The full flat parameter from every rank's shard (dtype of the shard)."""
        piece = torch.zeros(sharded.slot, dtype=sharded.shard.dtype, device=sharded.shard.device)
        piece[: sharded.end - sharded.start] = sharded.shard.detach()
        out = piece.new_empty(sharded.slot * self.world_size)
        all_gather_single(out, piece, group=self.group)
        self.comm.calls.append(("all_gather", sharded.numel * piece.element_size()))
        return out[: sharded.numel]

    def _reduce_scatter(self, sharded: _Sharded, grad: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the average over ranks of ``grad`` (a new tensor)."""
        padded = grad.new_zeros(sharded.slot * self.world_size)
        padded[: sharded.numel] = grad.reshape(-1)
        out = grad.new_empty(sharded.slot)
        reduce_scatter_single(out, padded, group=self.group)
        self.comm.calls.append(("reduce_scatter", sharded.numel * grad.element_size()))
        return out[: sharded.end - sharded.start] / self.world_size

    # -- gradients -------------------------------------------------------------

    def _accumulate(self, sharded: _Sharded, shard_grad: torch.Tensor) -> None:
        old = sharded.shard.grad
        sharded.shard.grad = shard_grad if old is None else old + shard_grad

    def _reduce_grad_hook(self, param: nn.Parameter) -> None:
        # Stages 2 and 3: keep only this rank's shard of the averaged gradient.
        self._accumulate(self._shards[param], self._reduce_scatter(self._shards[param], param.grad))
        param.grad = None
        if self.stage == 3:
            self._free(param)

    # -- stage 3: full parameters only while in use -----------------------------

    def _free(self, param: nn.Parameter) -> None:
        # Swapping .data keeps the Parameter object (and autograd's saved
        # reference to it) while its full storage is released.
        param.data = param.data.new_empty(0)

    def _gather(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if p in self._shards and p.data.numel() == 0:
                p.data = self._all_gather(self._shards[p]).view(self._shards[p].shape)
        in_use = sum(p.data.nbytes for p in self._shards)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, in_use)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._gather(module)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for p in module.parameters(recurse=False):
            if p in self._shards:
                self._free(p)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # Runs when the gradient of the output arrives, before this
                # module's backward needs the weights again.
                out.register_hook(lambda grad: self._gather(module))

    # -- the step ----------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients' shards, step this rank's shards, refresh the full parameters.

        Raises:
            RuntimeError: at stage 1, a trainable parameter has no gradient.
        """
        if self.stage == 1:
            for p, sharded in self._shards.items():
                if p.grad is None:
                    raise RuntimeError("a trainable parameter got no gradient before step()")
                # The averaged shard overwrites its own region of the full
                # gradient, so stage 1 holds no gradient bytes beyond DDP's.
                region = p.grad.view(-1)[sharded.start : sharded.end]
                region.copy_(self._reduce_scatter(sharded, p.grad))
                sharded.shard.grad = region
        self.optimizer.step()
        if self.stage < 3:
            for p, sharded in self._shards.items():
                p.view(-1).copy_(self._all_gather(sharded))

    def zero_grad(self) -> None:
        """Drop the gradients of the shards and of the full parameters."""
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)

    def shard_ranges(self) -> dict[str, tuple[int, int]]:
        """``[start, end)`` of each trainable parameter (flattened) that this rank owns, by name."""
        return {
            name: (self._shards[p].start, self._shards[p].end)
            for name, p in self.module.named_parameters()
            if p in self._shards
        }

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter by name, all-gathered (collective: call it on every rank)."""
        out = {}
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if p in self._shards:
                    out[name] = self._all_gather(self._shards[p]).view(self._shards[p].shape)
                else:
                    out[name] = p.detach().clone()
        return out
