"""The ATen operations that run, counted by name (lesson 14: what a checkpoint recomputes).

A ``TorchDispatchMode``
(https://pytorch.org/docs/stable/notes/extending.html#extending-all-torch-api-with-modes)
sees every operation below autograd, forward and backward alike, so a forward
operation seen during ``loss.backward()`` is a recomputation.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter"]


class OpCounter(TorchDispatchMode):
    """Count the ATen operations that run inside a ``with`` block, by name.

    Used around ``loss.backward()``: forward operations seen there (``aten.gelu``,
    ``aten.addmm``...) are recomputations. A ``TorchDispatchMode``
    (https://pytorch.org/docs/stable/notes/extending.html#extending-all-torch-api-with-modes)
    sees every operation below autograd.

    Attributes:
        counts: ``{"aten.gelu.default": 3, ...}``.
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
