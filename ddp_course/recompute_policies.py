"""Where to checkpoint: the policies that wrap parts of a TinyGPT, and op-level SAC.

The mechanisms (:func:`~ddp_course.activation_checkpoint.checkpoint`, reentrant,
and :func:`~ddp_course.activation_checkpoint.checkpoint_with_hooks`,
non-reentrant) are in :mod:`ddp_course.activation_checkpoint`; this module
decides which regions go through them. :func:`apply_policy` wraps parts of a
:class:`~ddp_course.models.TinyGPT` in place: every block, every other block,
every attention and MLP submodule, every ``nn.Linear`` (the anti-pattern: it
saves nothing), only the attention core (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 5, "selective
activation recomputation": QK^T, softmax, dropout and AV recomputed, the
``34 s b h`` terms kept), or every block with op-level selective activation
checkpointing (SAC, torchtitan's ``selective`` ``op`` mode:
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` saves the
matmul outputs, the ``a s^2 b`` scores included, and recomputes the
element-wise operations). Korthikanti's selective recomputation and op-level
SAC are opposite choices: the first recomputes the attention matmuls to drop
the quadratic tensors, the second keeps every matmul output and recomputes the
cheap rest. ``ddp_course.tools.op_counts.OpCounter`` counts what runs again in
backward. :func:`shard_with_checkpointing` composes the checkpoints with FSDP2's
``fully_shard`` in either order, or around the whole sharded model.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ddp_course.activation_checkpoint import checkpoint, checkpoint_with_hooks

__all__ = [
    "CheckpointWrapper",
    "CheckpointedCore",
    "IMPLS",
    "MATMULS",
    "ORDERS",
    "POLICIES",
    "SelectiveRecord",
    "apply_policy",
    "matmul_policy",
    "selective_checkpoint",
    "shard_with_checkpointing",
]

#: The operations selective checkpointing saves: their outputs cost FLOPs to rebuild.
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@dataclasses.dataclass
class SelectiveRecord:
    """What a selective-checkpointing policy decided, filled in as it runs.

    Attributes:
        saved_bytes: bytes of the outputs saved in forward (``numel *
            element_size`` of each output tensor of an operation the policy saves).
        saved_ops: names of the operations saved, in order.
        recompute_ops: names of the operations marked for recomputation in
            forward (run again in backward;
            ``ddp_course.tools.op_counts.OpCounter`` sees them there).
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
    bytes (``ddp_course.tools.saved_tensors.SavedTensorCounter``) would then count
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


#: The implementations of a whole-region checkpoint: the reentrant one from scratch
#: (:func:`checkpoint`), the non-reentrant one from scratch (:func:`checkpoint_with_hooks`)
#: and PyTorch's (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``).
IMPLS = ("ours", "hooks", "torch")


def _run_checkpointed(fn: Callable, impl: str, *inputs: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return fn(*inputs)
    if impl == "ours":
        return checkpoint(fn, *inputs)
    if impl == "hooks":
        return checkpoint_with_hooks(fn, *inputs)
    return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)


class CheckpointWrapper(nn.Module):
    """A module run through a checkpoint: ours (either form), PyTorch's, or op-level SAC.

    Args:
        module: the region; input and output one tensor each.
        impl: one of :data:`IMPLS` or ``"selective"`` (PyTorch's op-level
            selective checkpointing, with :func:`matmul_policy`).
        record: where ``"selective"`` writes its decisions (a new one if None).
        save: the operations ``"selective"`` saves (see :func:`matmul_policy`).

    Raises:
        ValueError: an unknown ``impl``.
    """

    def __init__(
        self,
        module: nn.Module,
        impl: str = "ours",
        record: SelectiveRecord | None = None,
        save: tuple = MATMULS,
    ):
        super().__init__()
        if impl not in (*IMPLS, "selective"):
            raise ValueError(f"impl must be one of {(*IMPLS, 'selective')}, not {impl!r}")
        self.module, self.impl = module, impl
        self.record = SelectiveRecord() if record is None else record
        self.save = save

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "selective" and torch.is_grad_enabled():
            return selective_checkpoint(self.module, x, matmul_policy(self.record, self.save))
        if self.impl == "selective":
            return self.module(x)
        return _run_checkpointed(self.module, self.impl, x)


class CheckpointedCore:
    """An attention's :meth:`~ddp_course.models.CausalSelfAttention.attention_core`
    run through a checkpoint: Korthikanti et al. 2022's selective recomputation.

    Assigned over the method (``attn.attention_core = CheckpointedCore(attn.
    attention_core)``), so only QK^T, the mask, softmax, dropout and AV are
    recomputed; the checkpoint keeps Q, K and V (``3 e s b h``), and the
    projections, LayerNorms and MLP keep what they save without it.

    Args:
        core: the bound method; ``core(q, k, v)`` with ``[B, heads, T, head_dim]`` each.
        impl: one of :data:`IMPLS`.
    """

    def __init__(self, core: Callable, impl: str = "ours"):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
        self.core, self.impl = core, impl

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _run_checkpointed(self.core, self.impl, q, k, v)


#: The policies :func:`apply_policy` knows, from none to the anti-pattern.
POLICIES = (
    "none",
    "every_block",
    "every_other_block",
    "every_submodule",
    "op_sac",
    "core_attention",
    "every_linear",
)


def apply_policy(model: nn.Module, policy: str, impl: str = "ours") -> SelectiveRecord:
    """Wrap the blocks of a TinyGPT in place as ``policy`` says.

    Policies (:data:`POLICIES`):

    - ``"none"``;
    - ``"every_block"``; ``"every_other_block"`` (blocks 0, 2, 4...);
    - ``"every_submodule"``: each block's ``attn`` and ``mlp`` on their own, the
      LayerNorms and residual adds left out;
    - ``"op_sac"`` (also accepted under its old name ``"selective"``): op-level
      selective activation checkpointing as torchtitan's ``op`` mode, every block
      through PyTorch's ``create_selective_checkpoint_contexts`` with
      :func:`matmul_policy` (matmul outputs saved, ``a s^2 b`` scores included;
      element-wise operations recomputed);
    - ``"core_attention"``: Korthikanti et al. 2022's selective recomputation,
      each attention core checkpointed (:class:`CheckpointedCore`): the ``a s^2 b``
      tensors recomputed, the ``34 s b h`` terms kept;
    - ``"every_linear"``: every ``nn.Linear`` inside the blocks on its own, the
      anti-pattern: a Linear saves its input, which is what its checkpoint
      keeps, so it saves nothing and reruns every matmul of forward.

    Args:
        model: a :class:`~ddp_course.models.TinyGPT` (anything with ``.blocks``).
        policy: one of the above.
        impl: one of :data:`IMPLS` for every policy but ``"op_sac"``.

    Returns:
        The :class:`SelectiveRecord` every op-level SAC wrapper writes to (empty
        for the other policies).

    Raises:
        ValueError: an unknown policy or ``impl``, or a model already wrapped.
    """
    policy = "op_sac" if policy == "selective" else policy
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
    if any(
        isinstance(m, CheckpointWrapper)
        or isinstance(getattr(m, "attention_core", None), CheckpointedCore)
        for m in model.modules()
    ):
        raise ValueError("the model is already wrapped: build a fresh one for another policy")
    record = SelectiveRecord()
    blocks = model.blocks
    for i, block in enumerate(blocks):
        if policy == "every_block" or (policy == "every_other_block" and i % 2 == 0):
            blocks[i] = CheckpointWrapper(block, impl)
        elif policy == "every_submodule":
            block.attn = CheckpointWrapper(block.attn, impl)
            block.mlp = CheckpointWrapper(block.mlp, impl)
        elif policy == "op_sac":
            blocks[i] = CheckpointWrapper(block, "selective", record)
        elif policy == "core_attention":
            block.attn.attention_core = CheckpointedCore(block.attn.attention_core, impl)
        elif policy == "every_linear":
            for parent in list(block.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, CheckpointWrapper(child, impl))
    return record


#: Where :func:`shard_with_checkpointing` puts the checkpoints relative to FSDP2's units.
ORDERS = ("no_ac", "ac_then_fsdp", "fsdp_then_ac", "ac_around_root")


def shard_with_checkpointing(
    model: nn.Module, order: str, impl: str = "torch", **fsdp_kwargs
) -> nn.Module:
    """FSDP2 over every block and the root of a TinyGPT, with checkpoints placed as
    ``order`` says; returns the module to call (the sharded model, or a wrapper).

    Orders (:data:`ORDERS`):

    - ``"no_ac"``: ``fully_shard`` each block, then the root;
    - ``"ac_then_fsdp"``: each block in a :class:`CheckpointWrapper`, then
      ``fully_shard`` of each wrapper and of the root: torchtitan's order
      (``torchtitan/models/llama3/infra/parallelize.py``: ``apply_ac``, then
      ``apply_fsdp``). The unit's hooks sit outside the checkpoint, so the
      recomputation runs the block alone, after the unit's pre-backward all-gather;
    - ``"fsdp_then_ac"``: ``fully_shard`` each block, then each sharded block in a
      :class:`CheckpointWrapper`: the recomputation runs the unit's forward hooks
      again, in backward;
    - ``"ac_around_root"``: ``"no_ac"``'s sharding, the whole root in one
      :class:`CheckpointWrapper`: backward's first use of a saved tensor reruns
      the whole forward, every block's all-gather included.

    Args:
        model: a :class:`~ddp_course.models.TinyGPT` (anything with ``.blocks``),
            sharded in place.
        order: one of the above.
        impl: the checkpoint's implementation, one of :data:`IMPLS`.
        fsdp_kwargs: passed to every ``fully_shard`` (``mesh``, ``mp_policy``,
            ``reshard_after_forward``...).

    Returns:
        ``model``, or for ``"ac_around_root"`` a :class:`CheckpointWrapper` around it;
        the parameters (and the optimizer's) are ``model.parameters()`` either way.

    Raises:
        ValueError: an unknown ``order`` or ``impl``.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
    blocks = model.blocks
    for i, block in enumerate(blocks):
        if order == "ac_then_fsdp":
            blocks[i] = fully_shard(CheckpointWrapper(block, impl), **fsdp_kwargs)
        else:
            fully_shard(block, **fsdp_kwargs)
            if order == "fsdp_then_ac":
                blocks[i] = CheckpointWrapper(block, impl)
    fully_shard(model, **fsdp_kwargs)
    return CheckpointWrapper(model, impl) if order == "ac_around_root" else model
