"""Activation checkpointing from scratch: the reentrant and the non-reentrant form.

Checkpointing a region keeps only its inputs in forward and runs the region
again in backward to rebuild what its backward needs (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", section 3): memory for
compute. The recomputation must run as the first forward did: with the same
random numbers, or dropout masks differ and so do the gradients, and under the
same autocast state, or it computes in another dtype. Both forms here save the
CPU (and CUDA) generator state and the autocast state before forward and
restore them for the recomputation, as ``torch.utils.checkpoint`` does with
``preserve_rng_state=True`` (https://pytorch.org/docs/stable/checkpoint.html):

- :class:`Checkpoint` / :func:`checkpoint`: the reentrant form, a
  ``torch.autograd.Function`` whose backward runs a forward and a backward of
  the region (``use_reentrant=True``);
- :func:`checkpoint_with_hooks`: the non-reentrant form, built from
  ``torch.autograd.graph.saved_tensors_hooks``: each tensor the region saves is
  packed as a handle, and the first unpack in backward reruns the region to
  rebuild them all (``use_reentrant=False``, what PyTorch recommends).

Where to apply them (the policies, and op-level selective checkpointing) is
:mod:`ddp_course.recompute_policies`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__ = [
    "Checkpoint",
    "RecomputedRegion",
    "ReplayState",
    "checkpoint",
    "checkpoint_with_hooks",
]


def _autocast_states(devices: set[str]) -> list[tuple[str, torch.dtype, bool]]:
    """``(device type, dtype, cache enabled)`` of each autocast active now, CPU included."""
    states = []
    for dev in sorted(devices | {"cpu"}):
        if torch.is_autocast_enabled(dev):
            states.append((dev, torch.get_autocast_dtype(dev), torch.is_autocast_cache_enabled()))
    return states


class ReplayState:
    """Put back, for a recomputation, the random and autocast state forward started from.

    Saved at construction (before the region's forward runs): the CPU
    generator, every CUDA generator when a CUDA tensor is among the inputs,
    and which autocast was on (device type, dtype). Used as a context manager
    around the recomputation: ``torch.random.fork_rng`` puts the generators
    back afterwards, so the training loop's random stream continues as if no
    recomputation had happened; autocast is entered as forward saw it, and
    exited afterwards (backward itself runs outside autocast).

    Args:
        inputs: the region's tensor inputs (their devices say which generators
            and which autocast to record).
        restore_rng: replay the generators (``False`` shows the dropout bug).
        restore_autocast: replay autocast (``False`` shows the autocast bug).
    """

    def __init__(self, inputs, restore_rng: bool = True, restore_autocast: bool = True):
        self.restore_rng = restore_rng
        self.cuda = any(x.is_cuda for x in inputs)
        self.cpu_state = torch.get_rng_state()
        self.cuda_state = torch.cuda.get_rng_state_all() if self.cuda else None
        devices = {x.device.type for x in inputs}
        self.autocast = _autocast_states(devices) if restore_autocast else []
        self._stack = None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        devices = list(range(torch.cuda.device_count())) if self.cuda else []
        self._stack.enter_context(torch.random.fork_rng(devices=devices, enabled=self.restore_rng))
        if self.restore_rng:
            torch.set_rng_state(self.cpu_state)
            if self.cuda:
                torch.cuda.set_rng_state_all(self.cuda_state)
        for dev, dtype, cache in self.autocast:
            self._stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=cache))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


class Checkpoint(torch.autograd.Function):
    """Run ``fn(*inputs)`` without saving its activations; rerun it in backward.

    Forward records the generator state and the autocast state it starts
    from, runs ``fn`` under ``torch.no_grad()`` (nothing inside is saved) and
    saves only ``inputs``. Backward restores both states (the rerun draws the
    same dropout masks and computes in the same dtypes as forward; without the
    autocast state a region run under ``torch.autocast`` would be recomputed in
    float32 and its gradients would differ), reruns ``fn`` with gradients on,
    and back-propagates the incoming gradients through it; parameters inside
    ``fn`` receive their gradients there. This is the "reentrant" form (a
    backward inside a backward).

    ``apply(fn, restore_rng, restore_autocast, *inputs)``: ``inputs`` are tensors, at least one
    of which requires a gradient (otherwise nothing connects the output to the
    parameters inside ``fn``); ``fn`` returns one tensor.

    Raises:
        ValueError: no input requires a gradient while gradients are on.
    """

    @staticmethod
    def forward(ctx, fn, restore_rng, restore_autocast, *inputs):
        ctx.fn = fn
        # The random and autocast state before fn runs, to run it again the same way.
        ctx.replay = ReplayState(inputs, restore_rng, restore_autocast)
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with ctx.replay, torch.enable_grad():  # forward's random numbers and autocast
            output = ctx.fn(*inputs)
        # A backward inside backward: the parameters in fn accumulate their .grad, the
        # detached inputs receive theirs, which this node hands on.
        torch.autograd.backward(output, grad_output)
        return (None, None, None, *[x.grad if x.requires_grad else None for x in inputs])


def checkpoint(
    fn: Callable, *inputs: torch.Tensor, restore_rng: bool = True, restore_autocast: bool = True
) -> torch.Tensor:
    """``fn(*inputs)``, keeping only ``inputs`` for backward and recomputing the rest.

    Args:
        fn: a module or function of tensors returning one tensor.
        inputs: tensors; at least one requires a gradient when gradients are on.
        restore_rng: replay the random numbers of forward in the recomputation
            (``False`` shows the bug: dropout draws new masks and the gradients
            are wrong).
        restore_autocast: rerun under the autocast forward ran under (``False``
            shows the bug: a region run under ``torch.autocast`` is recomputed
            in float32 and its gradients differ).

    Raises:
        ValueError: gradients are on and no input requires one.
    """
    if torch.is_grad_enabled() and not any(x.requires_grad for x in inputs):
        raise ValueError(
            "checkpoint needs an input that requires a gradient; call "
            "x.requires_grad_() on the first region's input"
        )
    return Checkpoint.apply(fn, restore_rng, restore_autocast, *inputs)


class RecomputedRegion:
    """The saved tensors of one checkpointed region, rebuilt on first use in backward."""

    def __init__(self, fn, inputs, restore_rng):
        self.fn, self.inputs = fn, inputs
        self.replay = ReplayState(inputs, restore_rng)
        self.meta: list[tuple] = []  # (shape, dtype) of each tensor forward saved
        self.tensors: dict[int, torch.Tensor] = {}

    def pack(self, tensor: torch.Tensor) -> int:
        # Forward: keep a handle (its position) instead of the tensor; nothing stays alive.
        self.meta.append((tuple(tensor.shape), tensor.dtype))
        return len(self.meta) - 1

    def unpack(self, handle: int) -> torch.Tensor:
        if handle not in self.tensors:  # first use in this backward: rerun the region
            self.recompute()
        return self.tensors.pop(handle)  # freed as soon as backward has used it

    def recompute(self) -> None:
        rebuilt = []

        def keep(t):  # the same operations save the same tensors, in the same order
            rebuilt.append(t.detach())
            return None

        inputs = [x.detach().requires_grad_(x.requires_grad) for x in self.inputs]
        with self.replay, torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda _: None):
                self.fn(*inputs)
        # The determinism check of torch.utils.checkpoint: the rerun must save what forward did.
        got = [(tuple(t.shape), t.dtype) for t in rebuilt]
        if got != self.meta:
            first = next(
                (i for i, (u, v) in enumerate(zip(got, self.meta)) if u != v),
                min(len(got), len(self.meta)),
            )
            raise RuntimeError(
                f"the recomputation saved {len(got)} tensors, forward {len(self.meta)}; they "
                f"first differ at tensor {first} (shape, dtype: rerun "
                f"{got[first] if first < len(got) else None}, forward "
                f"{self.meta[first] if first < len(self.meta) else None}): the region "
                "does not run the same way twice (its random or autocast state, or its code)"
            )
        self.tensors = dict(enumerate(rebuilt))


def checkpoint_with_hooks(
    fn: Callable, *inputs: torch.Tensor, restore_rng: bool = True
) -> torch.Tensor:
    """``fn(*inputs)`` checkpointed without a custom Function: the non-reentrant form.

    ``fn`` runs once with gradients on, so autograd records its graph as
    usual, but under ``torch.autograd.graph.saved_tensors_hooks`` whose pack
    hook replaces each tensor the region saves by a handle (an int). In
    backward, the first unpack reruns ``fn`` on detached copies of ``inputs``
    (random and autocast state replayed) with a pack hook that collects what
    the rerun saves, in the same order; each unpack then hands back its
    tensor and drops it. The region's graph belongs to the outer graph, so
    gradients flow to ``inputs`` and parameters directly: no backward inside a
    backward, no input needs ``requires_grad`` and ``fn`` may return any
    tensors. This is ``torch.utils.checkpoint.checkpoint(..., use_reentrant=
    False)`` in outline; torch's also stops the rerun early once every tensor
    needed is rebuilt (``early_stop``) and checks the rerun saved tensors of the
    same shapes and dtypes (``determinism_check``, done here too).

    Args:
        fn: a module or function of tensors.
        inputs: its tensor arguments.
        restore_rng: replay the random numbers of forward in the recomputation.

    Returns:
        What ``fn(*inputs)`` returns.

    Raises:
        RuntimeError: in backward, when the rerun saves other tensors than forward.
    """
    if not torch.is_grad_enabled():
        return fn(*inputs)
    region = RecomputedRegion(fn, inputs, restore_rng)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        return fn(*inputs)
