"""Activation checkpointing from scratch, and the policies that say where to apply it.

Checkpointing a region keeps only its inputs in forward and runs the region
again in backward to rebuild what its backward needs (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", section 3): memory for
compute. The recomputation must draw the same random numbers as the first
forward, or dropout masks differ and so do the gradients; :func:`checkpoint`
saves the CPU (and CUDA) generator state before forward and restores it for
the recomputation, as ``torch.utils.checkpoint`` does with
``preserve_rng_state=True``
(https://pytorch.org/docs/stable/checkpoint.html).

:func:`apply_policy` wraps parts of a :class:`~ddp_course.models.TinyGPT` in
place: every block, every other block, every attention and MLP submodule, or
every block with selective checkpointing (``torch.utils.checkpoint.
create_selective_checkpoint_contexts``: matmul outputs saved, element-wise
operations recomputed; Korthikanti et al. 2022, section 5).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "Checkpoint",
    "CheckpointWrapper",
    "MATMULS",
    "OpCounter",
    "SelectiveRecord",
    "apply_policy",
    "checkpoint",
    "matmul_policy",
    "selective_checkpoint",
]

#: The operations selective checkpointing saves: their outputs cost FLOPs to rebuild.
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class Checkpoint(torch.autograd.Function):
    """Run ``fn(*inputs)`` without saving its activations; rerun it in backward.

    Forward runs ``fn`` under ``torch.no_grad()`` (nothing inside is saved)
    and saves only ``inputs``. Backward restores the generator state that
    forward started from, reruns ``fn`` with gradients on, and back-propagates
    the incoming gradients through it; parameters inside ``fn`` receive their
    gradients there. This is the "reentrant" form (a backward inside a
    backward).

    ``apply(fn, restore_rng, *inputs)``: ``inputs`` are tensors, at least one
    of which requires a gradient (otherwise nothing connects the output to the
    parameters inside ``fn``); ``fn`` returns one tensor.

    Raises:
        ValueError: no input requires a gradient while gradients are on.
    """

    @staticmethod
    def forward(ctx, fn, restore_rng, *inputs):
        ctx.fn, ctx.restore_rng = fn, restore_rng
        ctx.cuda = any(x.is_cuda for x in inputs)
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_state = torch.cuda.get_rng_state_all() if ctx.cuda else None
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        devices = list(range(torch.cuda.device_count())) if ctx.cuda else []
        # fork_rng puts the generators back afterwards: the training loop's own random
        # stream continues as if no recomputation had happened.
        with torch.random.fork_rng(devices=devices, enabled=ctx.restore_rng):
            if ctx.restore_rng:
                torch.set_rng_state(ctx.cpu_state)
                if ctx.cuda:
                    torch.cuda.set_rng_state_all(ctx.cuda_state)
            with torch.enable_grad():
                output = ctx.fn(*inputs)
        # A backward inside backward: the parameters in fn accumulate their .grad, the
        # detached inputs receive theirs, which this node hands on.
        torch.autograd.backward(output, grad_output)
        return (None, None, *[x.grad if x.requires_grad else None for x in inputs])


def checkpoint(fn: Callable, *inputs: torch.Tensor, restore_rng: bool = True) -> torch.Tensor:
    """``fn(*inputs)``, keeping only ``inputs`` for backward and recomputing the rest.

    Args:
        fn: a module or function of tensors returning one tensor.
        inputs: tensors; at least one requires a gradient when gradients are on.
        restore_rng: replay the random numbers of forward in the recomputation
            (``False`` shows the bug: dropout draws new masks and the gradients
            are wrong).

    Raises:
        ValueError: gradients are on and no input requires one.
    """
    if torch.is_grad_enabled() and not any(x.requires_grad for x in inputs):
        raise ValueError(
            "checkpoint needs an input that requires a gradient; call "
            "x.requires_grad_() on the first region's input"
        )
    return Checkpoint.apply(fn, restore_rng, *inputs)


@dataclasses.dataclass
class SelectiveRecord:
    """What a selective-checkpointing policy decided, filled in as it runs.

    Attributes:
        saved_bytes: bytes of the outputs saved in forward (``numel *
            element_size`` of each output tensor of an operation the policy saves).
        saved_ops: names of the operations saved, in order.
        recompute_ops: names of the operations marked for recomputation in
            forward (run again in backward; :class:`OpCounter` sees them there).
    """

    saved_bytes: int = 0
    saved_ops: list[str] = dataclasses.field(default_factory=list)
    recompute_ops: list[str] = dataclasses.field(default_factory=list)


def _output_bytes(func, args, out) -> int:
    if out is None:
        # torch < 2.12 asks the policy before the operation runs, so read the output's
        # size off the inputs: a matrix product's from its operands, any other saved
        # operation's (softmax, element-wise) from its first input, whose shape it keeps.
        # (Running the operation on meta tensors would be exact, but an enclosing
        # FlopCounterMode would count it.)
        a, b = args[-2], args[-1]
        if func in MATMULS:
            return a.shape[:-1].numel() * b.shape[-1] * a.element_size()
        first = next(t for t in args if isinstance(t, torch.Tensor))
        return first.numel() * first.element_size()
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))


def matmul_policy(record: SelectiveRecord, save: tuple = MATMULS) -> Callable:
    """A policy for ``create_selective_checkpoint_contexts``: save ``save``'s outputs.

    Every operation in ``save`` (by default the matrix products ``mm``,
    ``addmm``, ``bmm``: most of a block's FLOPs) is ``MUST_SAVE``; everything
    else (element-wise operations, softmax, dropout, LayerNorm, copies) is
    ``PREFER_RECOMPUTE``, cheap to run again. Decisions are written to ``record``.
    """

    def policy(ctx, func, *args, **kwargs):
        # Older PyTorch also asks during the recomputation; record forward's decisions only.
        if func in save:
            if not ctx.is_recompute:
                record.saved_ops.append(str(func))
                out = getattr(ctx, "op_output", None)
                record.saved_bytes += _output_bytes(func, args, out)
            return CheckpointPolicy.MUST_SAVE
        if not ctx.is_recompute:
            record.recompute_ops.append(str(func))
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint(module: nn.Module, x: torch.Tensor, policy: Callable) -> torch.Tensor:
    """``torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)`` with the
    selective ``policy``, its saved tensors kept out of saved-tensor hooks on every
    torch the course supports.

    torch 2.15 announces (FutureWarning) that selective checkpointing will pass what
    it saves through the active ``saved_tensors_hooks``; a hook that counts saved
    bytes (:class:`ddp_course.activation_memory.SavedTensorCounter`) would then count
    them twice. ``respect_saved_tensors_hooks=False`` keeps today's behaviour where
    ``checkpoint`` has the argument (2.15 on); older torch has none and behaves so.
    """
    kw = {"context_fn": lambda: create_selective_checkpoint_contexts(policy)}
    if (
        "respect_saved_tensors_hooks"
        in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    ):
        kw["respect_saved_tensors_hooks"] = False
    return torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False, **kw)


class CheckpointWrapper(nn.Module):
    """A module run through a checkpoint: ours, PyTorch's, or PyTorch's selective one.

    Args:
        module: the region; input and output one tensor each.
        impl: ``"ours"`` (:func:`checkpoint`), ``"torch"``
            (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``) or
            ``"selective"`` (PyTorch's, with :func:`matmul_policy`).
        record: where ``"selective"`` writes its decisions (a new one if None).
        save: the operations ``"selective"`` saves (see :func:`matmul_policy`).

    Raises:
        ValueError: an unknown ``impl``.
    """

    def __init__(self, module: nn.Module, impl: str = "ours",
                 record: SelectiveRecord | None = None, save: tuple = MATMULS):  # fmt: skip
        super().__init__()
        if impl not in ("ours", "torch", "selective"):
            raise ValueError(f"impl must be 'ours', 'torch' or 'selective', not {impl!r}")
        self.module, self.impl = module, impl
        self.record = SelectiveRecord() if record is None else record
        self.save = save

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.module(x)
        if self.impl == "ours":
            return checkpoint(self.module, x)
        if self.impl == "selective":
            return selective_checkpoint(self.module, x, matmul_policy(self.record, self.save))
        return torch.utils.checkpoint.checkpoint(self.module, x, use_reentrant=False)


def apply_policy(model: nn.Module, policy: str, impl: str = "ours") -> SelectiveRecord:
    """Wrap the blocks of a TinyGPT in place as ``policy`` says.

    Policies: ``"none"``; ``"every_block"``; ``"every_other_block"`` (blocks
    0, 2, 4...); ``"every_submodule"`` (each block's ``attn`` and ``mlp`` on
    their own, the LayerNorms and residual adds left out); ``"selective"``
    (every block, PyTorch's selective checkpointing with :func:`matmul_policy`).

    Args:
        model: a :class:`~ddp_course.models.TinyGPT` (anything with ``.blocks``).
        policy: one of the above.
        impl: ``"ours"`` or ``"torch"`` for the whole-region policies.

    Returns:
        The :class:`SelectiveRecord` every selective wrapper writes to (empty
        for the other policies).

    Raises:
        ValueError: an unknown policy or ``impl``, or a model already wrapped.
    """
    policies = ("none", "every_block", "every_other_block", "every_submodule", "selective")
    if policy not in policies:
        raise ValueError(f"policy must be one of {policies}, not {policy!r}")
    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        raise ValueError("the model is already wrapped: build a fresh one for another policy")
    record = SelectiveRecord()
    blocks = model.blocks
    for i, block in enumerate(blocks):
        if policy == "every_block" or (policy == "every_other_block" and i % 2 == 0):
            blocks[i] = CheckpointWrapper(block, impl)
        elif policy == "every_submodule":
            block.attn = CheckpointWrapper(block.attn, impl)
            block.mlp = CheckpointWrapper(block.mlp, impl)
        elif policy == "selective":
            blocks[i] = CheckpointWrapper(block, "selective", record)
    return record


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
