"""FSDP2's units seen from one rank: when they all-gather, and what storage they hold (lesson 09).

:class:`UnitOrder` writes one timeline of the collectives a rank runs, as the
course's collective log (:class:`~ddp_course.tools.collective_log.CollectiveLog`)
sees them, between the moments each unit's forward starts and ends and its backward
starts, so that the order FSDP2's prefetching promises
(``FSDPModule.set_modules_to_forward_prefetch`` and
``set_modules_to_backward_prefetch``, https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)
can be asserted. :func:`parameter_storage_bytes` counts the bytes a module's
parameters really occupy on this rank: a model built on the ``meta`` device holds none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .collective_log import CollectiveLog
from .zero_counts import storage_bytes

__all__ = ["UnitOrder", "parameter_storage_bytes", "position", "unit_gather_bytes"]


def parameter_storage_bytes(module: nn.Module) -> int:
    """Bytes of memory ``module``'s parameters occupy on this rank, each storage once
    (:func:`~ddp_course.tools.zero_counts.storage_bytes`: a DTensor its local shard, a
    tensor on the ``meta`` device nothing)."""
    return storage_bytes(module.parameters())


def unit_gather_bytes(unit: nn.Module) -> int:
    """Bytes of the output of the all-gather FSDP2 runs for one unit (``fully_shard``'d).

    FSDP2 cuts dim 0 of every parameter into ``N`` pieces of ``ceil(rows / N)``
    rows (the last ones padded) and gathers them all in one call: ``N`` times the
    padded shards, ``N`` the size of the parameters' mesh. Counts the unit's own
    parameters (``unit.parameters()``), so units must not nest.

    Raises:
        TypeError: a parameter is not a DTensor (the unit is not sharded).
    """
    total = 0
    for p in unit.parameters():
        if not isinstance(p, DTensor):
            raise TypeError("unit_gather_bytes needs a fully_shard'ed unit (DTensor parameters)")
        n = p.device_mesh.size()
        rows = -(-p.shape[0] // n) if p.dim() else 1
        total += n * rows * (p[0].numel() if p.dim() else 1) * p.element_size()
    return total


class UnitOrder:
    """The collectives of one rank and its FSDP2 units' forward and backward, in order.

    ``with order.recording(): ...`` appends to :attr:`events`, in the order they
    happen, tuples ``(what, unit)``:

    - ``("all_gather", name)``, ``("reduce_scatter", name)``, ...: a collective, as
      the course's :class:`~ddp_course.tools.collective_log.CollectiveLog` logged it
      (its op), credited to the unit whose all-gather has those bytes
      (:func:`unit_gather_bytes`; a reduce-scatter of a unit's gradients has the
      same), or ``None`` (e.g. a loss all-reduced for printing);
    - ``("forward", name)``: the unit's forward starts. A forward pre-hook
      registered after ``fully_shard``'s, so FSDP2 has issued the all-gathers of
      its own pre-forward hook (the unit's, and those it prefetches) by then;
    - ``("forward done", name)``: the unit's forward returned (a forward hook after
      FSDP2's);
    - ``("backward", name)``: the gradient of the unit's output arrived, after
      FSDP2's pre-backward hook on it (its all-gather and backward prefetches).

    Args:
        units: ``{name: module}``, each ``fully_shard``'d, none inside another, with
            different all-gather bytes.

    Raises:
        ValueError: two units whose all-gathers have the same bytes (their
            collectives could not be told apart).
    """

    def __init__(self, units: dict[str, nn.Module]):
        self.units = units
        self.log = CollectiveLog()
        self.events: list[tuple[str, str | None]] = []
        self._by_bytes = {unit_gather_bytes(u): name for name, u in units.items()}
        if len(self._by_bytes) != len(units):
            raise ValueError("UnitOrder: two units all-gather the same bytes")
        self._logged = 0  # collectives of the log already in events

    def _note(self, what: str, name: str) -> None:
        self._flush()
        self.events.append((what, name))

    def _flush(self) -> None:
        """Move the collectives logged since the last event into the timeline."""
        for call in self.log.calls[self._logged :]:
            self.events.append((call["op"], self._by_bytes.get(call["bytes"])))
        self._logged = len(self.log.calls)

    @contextlib.contextmanager
    def recording(self) -> Iterator[UnitOrder]:
        """Log collectives and the units' hooks inside the ``with`` block, then unhook."""
        handles = []
        for name, unit in self.units.items():

            def started(module, args, name=name):
                self._note("forward", name)

            def done(module, args, output, name=name):
                self._note("forward done", name)
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(lambda grad: self._note("backward", name))

            handles.append(unit.register_forward_pre_hook(started))
            handles.append(unit.register_forward_hook(done))
        try:
            with self.log.recording():
                yield self
        finally:
            self._flush()
            for h in handles:
                h.remove()


def position(events: list, event: tuple[str, str | None], nth: int = 0) -> int:
    """Index in ``events`` (:attr:`UnitOrder.events`) of the ``nth`` (from 0) ``event``.

    ``event`` is ``(what, unit)``; events read back from JSON (lists) match too.

    Raises:
        ValueError: fewer than ``nth + 1`` such events.
    """
    found = [i for i, e in enumerate(events) if tuple(e) == tuple(event)]
    if len(found) <= nth:
        raise ValueError(f"{event} happens {len(found)} times, not {nth + 1}")
    return found[nth]
