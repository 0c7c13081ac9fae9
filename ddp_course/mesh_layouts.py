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
- ``pp``: :class:`~ddp_course.mesh_model.GPTStage` keeps a contiguous run of blocks (the first stage
  the embeddings, the last the final LayerNorm and head), driven by
  ``torch.distributed.pipelining`` (GPipe schedule).

Every function takes what it needs as arguments; nothing is kept at module level.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from .collectives import group_rank_and_size

__all__ = [
    "DP_KINDS",
    "LAYOUTS",
    "MESH_DIMS",
    "Layout",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "build_mesh",
    "data_rank",
    "layout",
    "mesh_groups",
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

    def check_model(self, n_heads: int, d_model: int, seq_len: int) -> None:
        """Refuse, before anything is built, a TinyGPT shape this layout cannot split.

        Args:
            n_heads, d_model, seq_len: the model's attention heads, width and tokens per
                sequence.

        Raises:
            ValueError: ``tp`` does not divide ``n_heads`` (each tensor-parallel rank keeps
                whole heads), ``n_heads`` does not divide ``d_model``, or, with sequence
                parallelism, ``tp`` does not divide ``seq_len``.
        """
        if n_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide the {n_heads} attention heads: "
                "each tensor-parallel rank keeps whole heads"
            )
        if d_model % n_heads:
            raise ValueError(f"{n_heads} heads do not divide d_model={d_model}")
        if self.sequence_parallel and seq_len % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide seq_len={seq_len}: sequence "
                "parallelism gives each rank seq_len/tp positions"
            )

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

    _, world = group_rank_and_size()
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
    """Split a :class:`TinyGPT` (or one of its pipeline stages) with ``parallelize_module``.

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
    model: nn.Module,
    mesh,
    lay: Layout,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
):
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
    DDP takes no such policy: :class:`~ddp_course.mesh_model.MeshModel` runs its forward
    under ``torch.autocast``.

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
