"""What autograd saves for backward, counted in bytes (lessons 13 and 14).

Every tensor an operation saves for its backward passes through the pack hook of
``torch.autograd.graph.saved_tensors_hooks``
(https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks), on any device.
One rule says what a saved tensor costs (:class:`MemorySpans`): the bytes it spans,
counted once however often they are saved. A tensor and its reshaped or transposed views
span the same memory (the 2-D view ``x.view(-1, d)`` that ``nn.Linear`` saves is ``x``;
q, k and v saving one LayerNorm output keep one tensor alive, not three). Two
instruments use it: :class:`SavedTensorCounter` (everything saved inside a ``with``
block, activations and weights apart: lesson 14) and :func:`saved_activation_bytes`
(what given modules save while their forward runs: lesson 13's tensor- and
sequence-parallel blocks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["MemorySpans", "SavedTensorCounter", "saved_activation_bytes"]


class MemorySpans:
    """The memory spans seen so far, each counted once: the one rule of this module.

    A saved tensor spans ``numel * element_size`` bytes from the address of its
    first element (``data_ptr()``); a view with the same start and size (a
    reshape, a transpose, another dtype over the same bytes) is the same span.
    Autograd holds a reference to every saved tensor until backward, so no other
    tensor of the same forward can reuse an address while it is counted.

    A slice cut from a larger tensor counts its own bytes only, though the whole
    storage stays alive while it is saved: lesson 13 cuts each rank's part of the
    sequence from one whole input with ``chunk`` and counts the part, what a rank
    of a real job holds. Every other tensor lessons 13 and 14 save spans its
    whole storage: there the rule is ``untyped_storage().nbytes()`` per storage.

    Args:
        tensors: spans seen from the start (a model's parameters, say).
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = ()):
        self._seen: set[tuple[int, int]] = set()
        for t in tensors:
            self.add(t)

    @staticmethod
    def nbytes(tensor: torch.Tensor) -> int:
        """Bytes ``tensor`` spans: ``numel * element_size``."""
        return tensor.numel() * tensor.element_size()

    def __contains__(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s span was seen before."""
        return (tensor.data_ptr(), self.nbytes(tensor)) in self._seen

    def add(self, tensor: torch.Tensor) -> bool:
        """Remember ``tensor``'s span; ``True`` the first time it is seen."""
        key = (tensor.data_ptr(), self.nbytes(tensor))
        new = key not in self._seen
        self._seen.add(key)
        return new


class SavedTensorCounter:
    """Count the bytes that autograd saves for backward inside a ``with`` block.

    Every tensor an operation saves passes through the pack hook of
    ``torch.autograd.graph.saved_tensors_hooks``. The bytes each saved tensor
    spans are counted once (:class:`MemorySpans`): its views count nothing more.
    The given parameters are counted apart: a weight saved for backward is
    memory the model holds anyway, not an activation.

    What was seen in one ``with`` block stays counted until :meth:`reset`.
    Tensors saved inside a checkpointed region of
    ``torch.utils.checkpoint`` (which installs hooks of its own) are not seen.

    Args:
        parameters: the model's parameters (not activations).
        count_views_once: ``False`` counts every saved tensor, views included:
            the wrong count lesson 14 shows once.

    Attributes:
        activation_bytes: bytes of the distinct non-parameter tensors saved.
        parameter_bytes: bytes of the distinct parameters saved.
        saved: one ``(shape, dtype, bytes, kind)`` tuple per saved tensor, in
            order; ``kind`` is ``"activation"``, ``"view"`` (memory seen
            before, 0 bytes) or ``"parameter"`` (its bytes, each time).
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = (), count_views_once: bool = True):
        self.count_views_once = count_views_once
        self._parameters = MemorySpans(parameters)
        self._hooks = None
        self.reset()

    def reset(self) -> None:
        """Forget what was counted."""
        self.activation_bytes = 0
        self.parameter_bytes = 0
        self.saved: list[tuple[tuple[int, ...], torch.dtype, int, str]] = []
        self._seen = MemorySpans()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor in self._parameters:
            kind, size = "parameter", MemorySpans.nbytes(tensor)
            if self._seen.add(tensor):
                self.parameter_bytes += size
        elif not self.count_views_once:
            kind, size = "activation", MemorySpans.nbytes(tensor)
            self.activation_bytes += size
        elif self._seen.add(tensor):
            kind, size = "activation", MemorySpans.nbytes(tensor)
            self.activation_bytes += size
        else:
            kind, size = "view", 0
        self.saved.append((tuple(tensor.shape), tensor.dtype, size, kind))
        return tensor

    def __enter__(self) -> SavedTensorCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


@contextlib.contextmanager
def saved_activation_bytes(modules: list[nn.Module], out: dict) -> Iterator[None]:
    """Add to ``out["bytes"]`` the bytes autograd saves for backward inside ``modules``' forward.

    Counts every tensor packed by ``torch.autograd.graph.saved_tensors_hooks``
    while one of ``modules`` runs its forward (between its forward pre-hook and
    its forward hook), except the modules' parameters (weights are not
    activations), the same memory once (:class:`MemorySpans`). For a LayerNorm
    over ``[B, t, d]``: its input ``B t d`` elements plus its mean and
    reciprocal standard deviation, ``B t`` each. ``out["shapes"]`` gets the
    shape of each counted tensor (the first view of the same memory), a list.

    Args:
        modules: the modules whose forward is watched (a block, or its LayerNorms).
        out: a dict the counts are added to (``"bytes"``: int, ``"shapes"``:
            list of lists of ints); keys absent until something is counted.
    """
    depth = [0]
    parameters = MemorySpans(p for m in modules for p in m.parameters())
    seen = MemorySpans()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if depth[0] and t not in parameters and seen.add(t):
            out["bytes"] = out.get("bytes", 0) + MemorySpans.nbytes(t)
            out.setdefault("shapes", []).append(list(t.shape))
        return t

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    handles = [
        h
        for m in modules
        for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in handles:
            h.remove()
