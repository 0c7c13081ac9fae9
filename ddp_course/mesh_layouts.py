"""TinyGPT on a device mesh: PyTorch's own parallelisms, one layout at a time (notebook 13).

A *layout* says how the ranks of a job are arranged: ``pp`` pipeline stages,
``dp`` data-parallel replicas (plain DDP, FSDP2 shards, or HSDP's replicas of
shards) and ``tp`` tensor-parallel shards, with ``pp * dp * tp`` equal to the
world size. The ranks form a :class:`~torch.distributed.device_mesh.DeviceMesh`
``torch.arange(world).view(pp, replicate, shard, tp)`` (``dp = replicate *
shard``); the last dimension varies fastest, so tensor-parallel peers are
neighbouring ranks (on one node, where the links are fastest), as in
Megatron-LM (Narayanan et al. 2021, section 3.3) and TorchTitan.

How each dimension is applied to :class:`~ddp_course.models.TinyGPT`, in
TorchTitan's order (tensor parallelism, then FSDP, inside a pipeline stage):

- ``tp``: ``parallelize_module`` (https://pytorch.org/docs/stable/distributed.tensor.parallel.html)
  with Megatron-LM's split (Shoeybi et al. 2019, section 3): q, k, v and
  ``mlp.fc1`` ``ColwiseParallel``, ``attn.proj`` and ``mlp.fc2``
  ``RowwiseParallel``, the head ``ColwiseParallel`` with its output left
  sharded over the vocabulary for ``loss_parallel()``; with sequence
  parallelism (Korthikanti et al. 2022, section 4.2.2) the LayerNorms run
  ``SequenceParallel`` on a ``[B, T/tp, d]`` slice of the sequence;
- ``dp``: ``DistributedDataParallel``, or FSDP2's ``fully_shard``
  (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html) per
  block and at the root over the ``shard`` dimension, or HSDP: ``fully_shard``
  over the 2-D (``replicate``, ``shard``) mesh;
- ``pp``: :class:`GPTStage` keeps a contiguous run of blocks (the first stage
  the embeddings, the last the final LayerNorm and head), driven by
  ``torch.distributed.pipelining`` (GPipe schedule).

Every function takes what it needs as arguments; nothing is kept at module level.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from .mesh_collectives import comm_debug_counts, expected_collectives
from .models import TinyGPT

__all__ = [
    "DP_KINDS",
    "LAYOUTS",
    "MESH_DIMS",
    "GPTStage",
    "Layout",
    "MeshModel",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "build_mesh",
    "comm_debug_counts",
    "data_rank",
    "expected_collectives",
    "expected_memory_bytes",
    "layout",
    "mesh_groups",
    "split_stages",
    "tensor_bytes",
    "token_mean_loss",
]

DP_KINDS = ("ddp", "fsdp", "hsdp")
MESH_DIMS = ("pp", "replicate", "shard", "tp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How ``pp * dp * tp`` ranks train one model.

    Attributes:
        name: a label for tables, e.g. ``"fsdp x tp"``.
        dp: data-parallel ranks: each takes ``1/dp`` of the global batch.
        tp: tensor-parallel ranks: each holds ``1/tp`` of the heads and MLP features.
        pp: pipeline stages: each holds ``n_layers/pp`` blocks.
        data: ``"ddp"`` (replicas), ``"fsdp"`` (shards over all ``dp`` ranks) or
            ``"hsdp"`` (``replicate`` replicas of ``shard``-way shards).
        replicate: HSDP's replica count (1 otherwise; ``dp`` for DDP).
        sequence_parallel: LayerNorms on a slice of the sequence (needs ``tp > 1``).

    Raises:
        ValueError: a size below 1, an unknown ``data``, ``replicate`` not dividing
            ``dp``, or sequence parallelism without tensor parallelism.
    """

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    data: str = "fsdp"
    replicate: int = 1
    sequence_parallel: bool = False

    def __post_init__(self):
        if min(self.dp, self.tp, self.pp, self.replicate) < 1:
            raise ValueError(f"{self.name}: dp, tp, pp and replicate must be at least 1")
        if self.data not in DP_KINDS:
            raise ValueError(f"data must be one of {DP_KINDS}, not {self.data!r}")
        if self.dp % self.replicate:
            raise ValueError(f"replicate={self.replicate} does not divide dp={self.dp}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism splits the tensor-parallel group: set tp > 1")

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: ``pp * dp * tp``."""
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh sizes along :data:`MESH_DIMS` (``pp``, ``replicate``, ``shard``, ``tp``)."""
        if self.data == "ddp":
            return (self.pp, self.dp, 1, self.tp)
        return (self.pp, self.replicate, self.dp // self.replicate, self.tp)


# The layouts lesson 13 checks on 4 ranks; each trains TinyGPT equal to one process.
LAYOUTS = {
    "ddp": dict(dp=4, data="ddp"),
    "fsdp": dict(dp=4),
    "tp": dict(tp=4),
    "tp+sp": dict(tp=4, sequence_parallel=True),
    "fsdp x tp": dict(dp=2, tp=2),
    "hsdp": dict(dp=4, data="hsdp", replicate=2),
    "pp x fsdp": dict(pp=2, dp=2),
}


def layout(name: str, world_size: int | None = None) -> Layout:
    """The named layout of :data:`LAYOUTS`, checked against the job's world size.

    Raises:
        ValueError: an unknown name, or a world size other than the layout's.
    """
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose from {sorted(LAYOUTS)}")
    lay = Layout(name, **LAYOUTS[name])
    if world_size is not None and world_size != lay.world_size:
        raise ValueError(
            f"layout {name!r} needs {lay.world_size} ranks (pp*dp*tp), the job has {world_size}: "
            f"launch torchrun --nproc_per_node={lay.world_size}"
        )
    return lay


def mesh_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """The process groups of every mesh dimension, computed without a process group.

    The mesh is ``torch.arange(prod(shape)).view(shape)``, as
    ``init_device_mesh`` lays it out; the groups of dimension ``d`` are the rows
    of the mesh with ``d`` moved last (ranks that differ only in coordinate ``d``).

    Args:
        shape: mesh sizes, e.g. ``(2, 2, 2)`` for pp x dp x tp on 8 ranks.
        names: one name per dimension.

    Returns:
        ``{name: [[ranks of group 0], [ranks of group 1], ...]}``, groups sorted.

    Raises:
        ValueError: ``shape`` and ``names`` differ in length, or a size is below 1.
    """
    if len(shape) != len(names) or min(shape, default=1) < 1:
        raise ValueError(f"need one positive size per name, got shape={shape}, names={names}")
    mesh = torch.arange(int(torch.tensor(shape).prod())).view(*shape)
    return {
        name: sorted(mesh.movedim(d, -1).reshape(-1, shape[d]).tolist())
        for d, name in enumerate(names)
    }


def build_mesh(lay: Layout, device_type: str):
    """``init_device_mesh(device_type, lay.shape, mesh_dim_names=MESH_DIMS)`` over the world.

    ``device_type`` comes from the job's device plan (``ctx.device.type``), so the
    same code runs on CPU with gloo and on GPUs with nccl.

    Raises:
        ValueError: the world size is not ``pp * dp * tp``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != lay.world_size:
        raise ValueError(
            f"layout {lay.name!r} has pp*dp*tp = {lay.world_size} ranks, the job has {world}"
        )
    return init_device_mesh(device_type, lay.shape, mesh_dim_names=MESH_DIMS)


def data_rank(mesh) -> int:
    """This rank's data-parallel index in ``0..dp-1``: which slice of the global batch it takes."""
    return mesh.get_local_rank("replicate") * mesh["shard"].size() + mesh.get_local_rank("shard")


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, sequence_parallel: bool = False, loss_parallel: bool = True
) -> nn.Module:
    """Split a :class:`TinyGPT` (or :class:`GPTStage`) over ``tp_mesh`` with ``parallelize_module``.

    q, k, v and ``mlp.fc1``: ``ColwiseParallel`` (each rank keeps ``heads/tp``
    whole heads and ``4d/tp`` hidden features; no communication in forward);
    ``attn.proj`` and ``mlp.fc2``: ``RowwiseParallel`` (one all-reduce of
    ``[B, T, d]`` each in forward). With ``sequence_parallel`` the
    LayerNorms get ``SequenceParallel`` and the row-parallel layers
    reduce-scatter to a ``[B, T/tp, d]`` sequence slice instead of
    all-reducing, the column-parallel ones all-gather it back (Korthikanti et
    al. 2022, section 4.2.2). The head is ``ColwiseParallel``: with
    ``loss_parallel`` its logits stay sharded over the vocabulary
    (``DTensor``, ``Shard(-1)``) and the loss must be computed inside
    ``torch.distributed.tensor.parallel.loss_parallel()``; otherwise they are
    gathered whole.

    Args:
        model: TinyGPT or a stage; changed in place.
        tp_mesh: a 1-D ``DeviceMesh`` (e.g. ``mesh["tp"]``).
        sequence_parallel: run LayerNorms on sequence shards.
        loss_parallel: leave the logits sharded over the vocabulary.

    Returns:
        ``model``.

    Raises:
        ValueError: ``tp_mesh.size()`` does not divide the heads, the vocabulary, or (with
            ``sequence_parallel``) the sequence length.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    n = tp_mesh.size()
    blocks = list(
        model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    )
    heads = blocks[0].attn.q.out_features // blocks[0].attn.head_dim if blocks else n
    if heads % n:
        raise ValueError(f"tp={n} does not divide the {heads} attention heads: pick tp | heads")
    seq = model.seq_len
    if sequence_parallel and seq % n:
        raise ValueError(f"tp={n} does not divide seq_len={seq}: sequence parallelism needs it")
    head = getattr(model, "head", None)
    if head is not None and head.out_features % n:
        raise ValueError(f"tp={n} does not divide the vocabulary of {head.out_features}")
    sp = sequence_parallel
    rowwise = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    block_plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": rowwise,
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": copy.copy(rowwise),
    }
    if sp:
        # The residual stream between blocks is a [B, T/tp, d] slice; attention and the
        # MLP need the whole sequence, so their inputs are all-gathered (Shard(1) -> Replicate).
        gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        block_plan.update(
            ln1=SequenceParallel(),
            ln2=SequenceParallel(),
            attn=PrepareModuleInput(**gather),
            mlp=PrepareModuleInput(**gather),
        )
    names = model.blocks.keys() if isinstance(model.blocks, nn.ModuleDict) else range(len(blocks))
    for block in blocks:
        parallelize_module(block, tp_mesh, copy.deepcopy(block_plan))
    plan = {}
    first = getattr(model, "tok_emb", None) is not None and len(blocks) > 0
    if sp and first:
        # The embeddings stay whole; the first block's input is cut into sequence slices
        # (Replicate -> Shard(1) is a local slice, no communication).
        plan[f"blocks.{next(iter(names))}"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    if head is not None:
        if sp:
            plan["ln_f"] = SequenceParallel()
        plan["head"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return model


def apply_data_parallel(
    model: nn.Module, mesh, lay: Layout, reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
):  # fmt: skip
    """Wrap ``model`` for the layout's data parallelism over ``mesh`` (see :func:`build_mesh`).

    ``"ddp"``: ``DistributedDataParallel`` over the ``replicate`` dimension's group, with
    ``gradient_as_bucket_view=True`` (the gradients live in its buckets: no second copy).
    ``"fsdp"``: ``fully_shard`` on each block, then on the root, over ``mesh["shard"]``;
    the blocks take ``reshard_after_forward``, the root PyTorch's default (``None``: kept
    gathered after forward, since backward starts with it; TorchTitan does the same) or
    ``False`` with ``reshard_after_forward=False``.
    ``"hsdp"``: the same over the 2-D ``mesh["replicate", "shard"]``: parameters sharded
    within a replica group, gradients reduce-scattered there and all-reduced across replicas.

    With ``param_dtype`` (FSDP2 and HSDP only) every unit gets FSDP2's
    ``MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)``: the
    sharded parameters, their gradients and the optimizer stay in the model's dtype
    (float32 master weights), the gathered parameters and the compute are in
    ``param_dtype``, gradients are reduced in float32 (TorchTitan's default; lesson 14).
    DDP takes no such policy: :class:`MeshModel` runs its forward under ``torch.autocast``.

    Returns:
        The wrapped model (DDP) or ``model`` (FSDP2 changes it in place).

    Raises:
        ValueError: DDP asked for with tensor parallelism (use FSDP over ``shard`` instead).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if lay.data == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if lay.tp > 1:
            raise ValueError("DDP of DTensor parameters is not supported here: use fsdp with tp")
        group = mesh["replicate"].get_group()
        # Gradients as views into DDP's buckets: one copy of them, not two (lesson 07).
        return DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True)
    sub = mesh["replicate", "shard"] if lay.data == "hsdp" else mesh["shard"]
    kw = {"mesh": sub, "reshard_after_forward": reshard_after_forward}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        fully_shard(block, **kw)
    # The root: None lets FSDP2 keep it gathered (True would gather it again at once).
    fully_shard(model, **{**kw, "reshard_after_forward": None if reshard_after_forward else False})
    return model


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`TinyGPT`: a contiguous run of its blocks.

    The first stage also holds the embeddings (input ``int64 [B, T]``), the last
    the final LayerNorm and the head (output logits ``[B, T, V]``); the others map
    ``[B, T, d]`` to ``[B, T, d]``. Blocks keep their index as name
    (``blocks.3.attn.q.weight``), so parameter names equal the whole model's.

    Args:
        model: the whole TinyGPT; its modules are shared, not copied.
        first, last: block indices ``first <= i < last`` this stage keeps.
    """

    def __init__(self, model: TinyGPT, first: int, last: int):
        super().__init__()
        n_layers = len(model.blocks)
        self.seq_len = model.seq_len
        is_first, is_last = first == 0, last == n_layers
        self.tok_emb = model.tok_emb if is_first else None
        self.pos_emb = model.pos_emb if is_first else None
        self.drop = model.drop if is_first else None  # the embeddings' dropout, as in TinyGPT
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        self.ln_f = model.ln_f if is_last else None
        self.head = model.head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def split_stages(model: TinyGPT, stages: int) -> list[GPTStage]:
    """Cut ``model`` into ``stages`` :class:`GPTStage` s of equal numbers of blocks.

    Raises:
        ValueError: ``stages`` does not divide the number of blocks.
    """
    n_layers = len(model.blocks)
    if stages < 1 or n_layers % stages:
        raise ValueError(f"pp={stages} must divide the {n_layers} blocks of the model")
    per = n_layers // stages
    return [GPTStage(model, s * per, (s + 1) * per) for s in range(stages)]


def token_mean_loss(
    logits: torch.Tensor, targets: torch.Tensor, group=None, ignore_index: int = -100
) -> torch.Tensor:
    """Cross-entropy per *global* token, for sequences padded with ``ignore_index``.

    Each data-parallel rank sums its token losses and divides by the number of
    real tokens of the whole global batch (all-reduced over ``group``), then
    multiplies by the group's size, because DDP and FSDP *average* gradients
    over the ranks: the averaged gradient is then that of (sum of every token
    loss) / (global token count), the one-process loss, whatever the layout.
    Averaging per-rank means instead weights a token by 1 / (its rank's token
    count), which depends on how the batch is split.

    Args:
        logits: ``[B, T, V]``, this rank's slice of the batch.
        targets: ``int64 [B, T]``; padded positions hold ``ignore_index``.
        group: the data-parallel process group; ``None`` with no process group
            means one process.

    Returns:
        A scalar in the logits' dtype.

    Raises:
        ValueError: the global batch has no real token.
    """
    total = functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    count = (targets != ignore_index).sum().to(torch.float64)
    size = 1
    if dist.is_initialized():
        dist.all_reduce(count, group=group)
        size = dist.get_world_size(group)
    if count.item() == 0:
        raise ValueError("the global batch has no token other than ignore_index")
    return total * size / count.to(total.dtype)


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors this rank holds: local shards for ``DTensor`` s.

    Args:
        tensors: an iterable of tensors (``None`` skipped).

    Returns:
        Sum of ``numel * element_size`` of each tensor's local part, in bytes.
    """
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def expected_memory_bytes(model: TinyGPT, lay: Layout, element_size: int, stage: int = 0) -> dict:
    """Bytes of parameters, gradients and AdamW state one rank holds, from the layout.

    The ZeRO rule (Rajbhandari et al. 2020, section 5): DDP divides nothing;
    FSDP divides parameters, gradients and optimizer state by the ``shard``
    size (HSDP: by ``shard`` only, the replicas hold copies); tensor
    parallelism divides the split weights (q, k, v, proj, fc1, fc2 weights,
    the biases of q, k, v, fc1, the head) by ``tp`` and keeps the rest whole;
    the pipeline keeps only its stage's parameters. AdamW keeps two states
    (``exp_avg``, ``exp_avg_sq``) of each parameter's shape; its scalar
    ``step`` counters are left out.

    Args:
        model: the whole (unsplit) TinyGPT.
        lay: the layout.
        element_size: bytes per element (8 for float64).
        stage: this rank's pipeline stage.

    Returns:
        ``{"params": bytes, "grads": bytes, "optimizer": bytes}``.
    """
    shard = lay.shape[2]
    keep = split_stages(model, lay.pp)[stage] if lay.pp > 1 else model
    split = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc1.")
    params = 0
    for name, p in keep.named_parameters():
        n = p.numel()
        tp_split = (
            name.startswith("head.")
            or (".attn." in name or ".mlp." in name)
            and (any(s in name for s in split) or name.endswith("weight"))
        )
        if tp_split:
            n //= lay.tp
        params += n // shard
    b = params * element_size
    return {"params": b, "grads": b, "optimizer": 2 * b}


class MeshModel:
    """TinyGPT laid out on a mesh: the parallelised module and one training step.

    Builds the layout in TorchTitan's order: pipeline stage, tensor parallelism,
    data parallelism. :meth:`forward_backward` takes this rank's slice of the
    global batch, leaves the gradients in the parameters and returns the loss
    averaged over the whole global batch.

    Args:
        model: a whole TinyGPT, the same weights on every rank (changed in place).
        lay: the layout.
        mesh: :func:`build_mesh` of ``lay``.
        microbatches: micro-batches per step of the pipeline schedule (GPipe).
        loss_parallel: with tensor parallelism, compute the loss on vocabulary shards.
        reshard_after_forward: FSDP2's choice (False keeps the gathered parameters
            for backward: fewer all-gathers, more memory).
        compute_dtype: mixed precision (``torch.bfloat16``): the parameters stay in
            ``model``'s dtype; FSDP2 and HSDP compute in ``compute_dtype`` through their
            ``MixedPrecisionPolicy`` (:func:`apply_data_parallel`), DDP under
            ``torch.autocast`` (forward and loss; backward follows the forward's dtypes).
            The loss is computed on float32 logits. ``None``: compute in ``model``'s dtype.

    Raises:
        ValueError: ``compute_dtype`` with DDP inside a pipeline (its schedule runs
            forward and backward together, so autocast cannot cover the forward alone).
    """

    def __init__(self, model: TinyGPT, lay: Layout, mesh, microbatches: int = 2,
                 loss_parallel: bool = True, reshard_after_forward: bool = True,
                 compute_dtype: torch.dtype | None = None):  # fmt: skip
        if compute_dtype is not None and lay.data == "ddp" and lay.pp > 1:
            raise ValueError("mixed precision with DDP inside a pipeline: use fsdp")
        self.layout, self.mesh = lay, mesh
        self.compute_dtype = compute_dtype
        self.loss_parallel = loss_parallel and lay.tp > 1
        self.stage_index = mesh.get_local_rank("pp")
        module = split_stages(model, lay.pp)[self.stage_index] if lay.pp > 1 else model
        if lay.tp > 1:
            apply_tensor_parallel(module, mesh["tp"], lay.sequence_parallel, self.loss_parallel)
        fsdp_dtype = compute_dtype if lay.data != "ddp" else None
        self.module = apply_data_parallel(module, mesh, lay, reshard_after_forward, fsdp_dtype)
        # The data-parallel ranks: one group, or HSDP's two (summing over both sums over dp).
        self.dp_groups = [mesh[n].get_group() for n in ("replicate", "shard") if mesh[n].size() > 1]
        self.schedule = None
        if lay.pp > 1:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            device = next(model.parameters()).device
            stage = PipelineStage(self.module, self.stage_index, lay.pp, device,
                                  group=mesh["pp"].get_group())  # fmt: skip
            # scale_grads divides the summed micro-batch gradients by their number:
            # the gradient of the mean over the whole slice.
            self.schedule = ScheduleGPipe(stage, microbatches, loss_fn=self.loss,
                                          scale_grads=True)  # fmt: skip

    @staticmethod
    def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``[B, T, V]`` logits; 16-bit logits are upcast to float32
        first (the log-softmax over V in bfloat16 would round every probability)."""
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of this slice, on vocabulary shards under loss parallelism."""
        from torch.distributed.tensor.parallel import loss_parallel

        if not self.loss_parallel:
            return self.cross_entropy(logits, targets)
        with loss_parallel():
            return self.cross_entropy(logits, targets)

    def autocast(self):
        """``torch.autocast`` to ``compute_dtype`` for DDP's forward; a no-op otherwise."""
        if getattr(self, "compute_dtype", None) is None or self.layout.data != "ddp":
            return contextlib.nullcontext()  # also for subclasses that set up their own layout
        device_type = next(self.module.parameters()).device.type
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of this rank's slice ``int64 [B/dp, T]``; the global mean loss.

        Raises:
            ValueError: an empty slice.

        Returns:
            The loss of the whole global batch (the mean over data-parallel ranks of
            the slices' means, equal since the slices hold equal token counts), on every rank.
        """
        from torch.distributed.tensor.parallel import loss_parallel

        if x.shape[0] == 0:
            # An empty slice would leave this rank out of its groups' collectives: a hang.
            raise ValueError("this rank's slice of the batch is empty: give every "
                             "data-parallel rank at least one sequence")  # fmt: skip
        if self.schedule is not None:
            first, last = self.stage_index == 0, self.stage_index == self.layout.pp - 1
            losses = []
            self.schedule.step(*([x] if first else []), target=y if last else None,
                               losses=losses if last else None)  # fmt: skip
            local = (
                torch.stack(losses).mean().detach()
                if last
                else torch.zeros((), dtype=torch.float64)
            )
            local = local.to(torch.float64).to(x.device)
            # The last stage knows the loss; the pipeline group shares it.
            dist.all_reduce(local, group=self.mesh["pp"].get_group())
        else:
            if self.loss_parallel:
                with loss_parallel():
                    loss = self.cross_entropy(self.module(x), y)
                    loss.backward()
            else:
                with self.autocast():
                    loss = self.loss(self.module(x), y)
                loss.backward()
            local = loss.detach()
            local = (local.full_tensor() if hasattr(local, "full_tensor") else local).to(
                torch.float64
            )
        for group in self.dp_groups:
            dist.all_reduce(local, group=group)
        return (local / self.layout.dp).item()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Whole parameters this rank's stage holds, by the unsplit model's names (a collective)."""
        out = {}
        for name, p in self.module.named_parameters():
            name = name.removeprefix("module.")
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        return out
