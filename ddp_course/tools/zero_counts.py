"""What a rank holds and what its collectives moved, measured on this rank (lesson 09).

:func:`held_bytes` counts the parameters, gradients and optimizer state a rank holds,
from the tensors themselves; :class:`CollectiveBytes` the bytes of every collective it
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

__all__ = ["CollectiveBytes", "held_bytes", "storage_bytes"]


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
        return [(c["op"], c["bytes"]) for c in self.log.calls
                if c["op"] not in ("send", "recv", "barrier")]  # fmt: skip

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


def storage_bytes(tensors: Any, seen: set[int] | None = None) -> int:
    """Bytes of memory ``tensors`` occupy on this rank, each storage once.

    A view (a shard of a full parameter, DDP's gradients in its buckets) costs
    nothing more than the storage it views; a DTensor (FSDP2) counts its local shard
    only; a tensor on the ``meta`` device counts 0: it has a shape and a dtype but no
    data, though its ``untyped_storage().nbytes()`` reports the size it would have.
    Anything that is not a tensor (``None`` gradients) is skipped.

    Args:
        tensors: an iterable of tensors.
        seen: storages counted already (their ``data_ptr``), updated in place, so
            that several calls count a storage shared between them once.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and hasattr(t, "to_local"):
            t = t.to_local()  # a DTensor: this rank's shard
        if not isinstance(t, torch.Tensor) or t.is_meta or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def held_bytes(
    model: ZeRO | nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state this rank holds right now.

    Counted from the tensors themselves, each storage once (a shard that is a
    view of the full parameter, or DDP's gradients viewed into its buckets,
    cost nothing more): the module's parameters and their ``.grad``, a
    :class:`~ddp_course.sharding.ZeRO`'s shards (the parameters its optimizer
    steps) and their ``.grad``, and every tensor in the optimizer's state (Adam's
    ``step`` counters included). A DTensor (FSDP2, ``torch.distributed.tensor``)
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
    seen: set[int] = set()

    if isinstance(model, ZeRO):
        # ZeRO builds its optimizer on this rank's shards only, so its parameters are the shards.
        optimizer = model.optimizer
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        params = list(model.module.parameters()) + shards
    elif optimizer is None:
        raise ValueError("held_bytes(module) needs the module's optimizer: held_bytes(m, opt)")
    else:
        params = list(model.parameters())
    grads = [p.grad for p in params]
    state = [t for st in optimizer.state.values() for t in st.values()]
    held = (storage_bytes(tensors, seen) for tensors in (params, grads, state))
    return StateBytes(*(float(b) for b in held))
