"""What a rank holds and what its collectives moved, measured on this rank (lesson 09).

:func:`held_bytes` counts the parameters, gradients and optimizer state a rank holds,
from the tensors themselves, by the course's one rule (:func:`storage_bytes`, each storage
once; :func:`held_state_bytes`, the same for any parameters and optimizer, lessons 02,
08, 09, 13 and 14); :class:`CollectiveBytes` the bytes of every collective it
ran, as the course's one collective log
(:class:`~ddp_course.tools.collective_log.CollectiveLog`) saw them. They check what
:mod:`ddp_course.sharding` says: the ZeRO paper's memory per rank
(:func:`~ddp_course.sharding.state_bytes_per_rank`) and ZeRO's own log of its calls
(:class:`~ddp_course.sharding.CommLog`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..sharding import StateBytes, ZeRO
from .collective_log import CollectiveLog

__all__ = ["CollectiveBytes", "held_bytes", "held_state_bytes", "storage_bytes"]


class CollectiveBytes:
    """Every collective run while active, with its tensor's bytes: ``(op, bytes)`` pairs.

    A counter that does not trust the code it checks: a view of the course's one
    collective log (:class:`ddp_course.tools.collective_log.CollectiveLog`),
    which sits in PyTorch's dispatcher (as ``torch.distributed.tensor.debug.CommDebugMode``
    does), so it sees the ``c10d`` operations DDP's reducer, ``ZeroRedundancyOptimizer``,
    FSDP2 and :class:`ddp_course.sharding.ZeRO` really call, from Python or C++, and reads
    the bytes off the tensors handed to them: padding included, no bookkeeping.

    Bytes of one call are the full (unsharded) tensor's, as
    :class:`ddp_course.sharding.CommLog` counts them: the tensor of an all-reduce or a
    broadcast, the output of an all-gather, the input of a reduce-scatter. Sends,
    receives and barriers are left out.

    Use::

        with CollectiveBytes() as sent:
            loss.backward()
            optimizer.step()
        sent.calls        # [("all_reduce", 4096), ("broadcast", 1024), ...]
        sent.volume_bytes

    Raises:
        RuntimeError: entered without a process group.
    """

    def __init__(self) -> None:
        self.log = CollectiveLog()
        self._recording = None

    def __enter__(self) -> CollectiveBytes:
        self._recording = self.log.recording()
        self._recording.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._recording.__exit__(*exc)

    @property
    def calls(self) -> list[tuple[str, int]]:
        """``(op, bytes)`` in call order; op is ``"all_reduce"``, ``"broadcast"``,
        ``"all_gather"``, ``"reduce_scatter"`` or another of the log's ops."""
        return [
            (c["op"], c["bytes"])
            for c in self.log.calls
            if c["op"] not in ("send", "recv", "barrier")
        ]

    def bytes_of(self, op: str) -> int:
        """Bytes of every call of ``op`` (e.g. ``"broadcast"``) added up."""
        return sum(b for o, b in self.calls if o == op)

    @property
    def volume_bytes(self) -> int:
        """Bytes in the ZeRO paper's units (section 7): an all-reduce of b bytes counts 2b.

        A ring all-reduce is a reduce-scatter plus an all-gather (lesson 04);
        a broadcast, an all-gather and a reduce-scatter of b bytes count b.
        """
        return sum(2 * b if op == "all_reduce" else b for op, b in self.calls)


def storage_bytes(tensors: Any, seen: set[int] | None = None, *, per_tensor: bool = False) -> int:
    """Bytes of memory ``tensors`` occupy on this rank, each storage once: the course's
    one rule for the bytes a rank holds.

    A view (a shard of a full parameter, DDP's gradients in its buckets) costs
    nothing more than the storage it views; a DTensor (FSDP2, tensor parallelism)
    counts its local shard only; a tensor on the ``meta`` device counts 0: it has a
    shape and a dtype but no data, though its ``untyped_storage().nbytes()`` reports
    the size it would have. Anything that is not a tensor (``None`` gradients, an
    optimizer's float ``step``) is skipped.

    Args:
        tensors: an iterable of tensors.
        seen: storages counted already (their ``data_ptr``), updated in place, so
            that several calls count a storage shared between them once.
        per_tensor: count ``numel * element_size`` of every tensor (its local shard
            for a DTensor) instead, views and shared storages again each time, and
            no padding. Lesson 13 counts so: its formulas are in elements of the
            shards, while FSDP2 keeps a shard in a buffer padded to an even split,
            which its storage's bytes would include. ``seen`` is then unused.

    Returns:
        Bytes, an ``int``.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and hasattr(t, "to_local"):
            t = t.to_local()  # a DTensor: this rank's shard
        if not isinstance(t, torch.Tensor) or t.is_meta or t.numel() == 0:
            continue
        if per_tensor:
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def held_state_bytes(
    params: Any, optimizer: torch.optim.Optimizer | None = None, *, per_tensor: bool = False
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds right now.

    Every tensor is counted by :func:`storage_bytes` (each storage once over all four
    kinds, a DTensor's local shard). Adam's and AdamW's ``step`` counters are
    counted apart, as ``"steps"``: one 4-byte float32 tensor per parameter tensor
    (``capturable=False``, the default), so they grow with the number of tensors, not
    of parameters. The formulas the lessons check (the ZeRO paper's 16 bytes a
    parameter, Kingma and Ba's two moments) leave them out; keeping them in a key
    of their own lets a lesson compare ``"optimizer"`` with such a formula and still
    account for every byte (the four values add up to all a rank holds).

    Args:
        params: an iterable of the parameters (their ``.grad`` are the gradients).
        optimizer: the optimizer stepping them, or ``None`` (no state: 0 bytes).
        per_tensor: passed to :func:`storage_bytes` (``numel * element_size`` of
            every tensor, lesson 13's count).

    Returns:
        ``{"params", "grads", "optimizer", "steps"}`` in bytes; ``"optimizer"`` is every
        state tensor but the ``step`` counters (Adam's ``exp_avg`` and ``exp_avg_sq``,
        SGD's ``momentum_buffer``).
    """
    params = list(params)
    state = [] if optimizer is None else list(optimizer.state.values())
    kinds = {
        "params": params,
        "grads": [p.grad for p in params],
        "optimizer": [t for st in state for k, t in st.items() if k != "step"],
        "steps": [st["step"] for st in state if "step" in st],
    }
    seen: set[int] = set()
    return {k: storage_bytes(ts, seen, per_tensor=per_tensor) for k, ts in kinds.items()}


def held_bytes(
    model: ZeRO | nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state this rank holds right now.

    Counted from the tensors themselves, each storage once (a shard that is a
    view of the full parameter, or DDP's gradients viewed into its buckets,
    cost nothing more): the module's parameters and their ``.grad``, a
    :class:`~ddp_course.sharding.ZeRO`'s shards (the parameters its optimizer
    steps) and their ``.grad``, and every tensor in the optimizer's state
    (:func:`held_state_bytes`; Adam's ``step`` counters added to the optimizer's, as
    lesson 09 counts them). A DTensor (FSDP2, ``torch.distributed.tensor``)
    counts its local shard only.

    Args:
        model: a :class:`~ddp_course.sharding.ZeRO`, or any module (e.g. DDP's
            ``.module``).
        optimizer: the optimizer stepping ``model``'s parameters; required
            unless ``model`` is a ``ZeRO`` (which has its own).

    Returns:
        A :class:`~ddp_course.sharding.StateBytes` in bytes, this rank only.

    Raises:
        ValueError: ``optimizer`` missing for a plain module.
    """
    if isinstance(model, ZeRO):
        # ZeRO builds its optimizer on this rank's shards only, so its parameters are the shards.
        optimizer = model.optimizer
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        params = list(model.module.parameters()) + shards
    elif optimizer is None:
        raise ValueError("held_bytes(module) needs the module's optimizer: held_bytes(m, opt)")
    else:
        params = list(model.parameters())
    held = held_state_bytes(params, optimizer)
    # StateBytes has three kinds: the step counters go with the optimizer's state here,
    # as lesson 09's tables and assertions count them (4 bytes a stepped tensor).
    return StateBytes(
        float(held["params"]), float(held["grads"]), float(held["optimizer"] + held["steps"])
    )
