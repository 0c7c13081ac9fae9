"""Which collective runs on which mesh dimension, per training step of a layout (notebook 13).

:func:`expected_collectives` predicts, from a :class:`~ddp_course.mesh_layouts.Layout`
and the number of blocks, how many all-gathers, reduce-scatters, all-reduces and
point-to-point batches one training step of TinyGPT makes on each mesh dimension;
:func:`count_step` runs one step of a :class:`~ddp_course.mesh_layouts.MeshModel`
and counts them, per phase:

- ``torch.distributed``'s Python calls (FSDP2, the pipeline's sends, our own
  code) with :class:`ddp_course.comm_cost.CollectiveLog`, which names the mesh
  dimension of each call's process group;
- DTensor's functional collectives (tensor parallelism) with PyTorch's
  ``CommDebugMode`` (https://pytorch.org/docs/stable/distributed.tensor.html,
  debugging), all on ``tp``;
- DDP's bucket all-reduces, which its C++ reducer issues, through a
  communication hook (:func:`count_ddp_buckets`; ``register_comm_hook``,
  https://pytorch.org/docs/stable/ddp_comm_hooks.html).

Kept apart from :mod:`ddp_course.mesh_layouts`, which builds the layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

__all__ = [
    "BucketCounter",
    "comm_debug_counts",
    "count_ddp_buckets",
    "count_step",
    "expected_collectives",
]


def expected_collectives(
    lay, n_layers: int, reshard_after_forward: bool = True, microbatches: int = 2,
    ddp_buckets: int = 1,
) -> dict:  # fmt: skip
    """Collectives of one training step of TinyGPT per mesh dimension, from the layout.

    Per step, with ``L`` blocks (``L/pp`` per pipeline stage), FSDP2 units =
    the blocks and the root (embeddings, final LayerNorm, head, or the stage),
    and tensor-parallel plans as in :func:`ddp_course.mesh_layouts.apply_tensor_parallel`
    (loss on vocabulary shards):

    - ``shard`` (FSDP2, HSDP's shard groups): one all-gather per unit in forward;
      in backward one again per block when ``reshard_after_forward`` (the root
      keeps its gathered parameters: PyTorch's default for the root, since
      backward starts with it); one reduce-scatter of gradients per unit;
    - ``replicate`` (HSDP): one all-reduce of each unit's gradient shard
      across the replicas, in backward; (DDP): one all-reduce per gradient
      bucket (``ddp_buckets``: the first holds up to 1 MiB, the next
      ``bucket_cap_mb`` = 25 MiB each; TinyGPT fits in one);
    - ``tp`` without sequence parallelism: forward, one all-reduce per
      row-parallel layer (proj, fc2): ``2L``; backward, one all-reduce of the
      input gradient per column-parallel layer whose input is replicated (q, k,
      v, fc1, each on its own: ``4L``, Megatron-LM's fused f would make it
      ``2L``) and the head: ``4L+1``; the vocabulary-parallel cross-entropy: 3
      all-reduces (the max, the sum of exponentials, the target's logit);
    - ``tp`` with sequence parallelism: all-reduces become a reduce-scatter
      (forward, proj and fc2: ``2L``) and an all-gather (forward, before
      attention, the MLP and the head: ``2L+1``); backward swaps them (``2L+1``
      reduce-scatters, ``2L+1`` all-gathers: ``2L`` conjugates and one for the
      first block's sequence slice), and the LayerNorms' replicated weights and
      biases get their partial gradients all-reduced: ``2(2L+1)``;
    - ``pp`` (GPipe over ``microbatches``, FSDP inside each stage): the step is
      one phase, ``"step"``. FSDP2 gathers each block again for every
      micro-batch's forward (``microbatches`` all-gathers per block when
      ``reshard_after_forward``), the root once; in backward PyTorch's stage
      keeps the gathered blocks until the last micro-batch
      (``set_reshard_after_backward(last)``) and reduce-scatters only after it
      (``set_requires_gradient_sync(last)``): one more all-gather per block,
      one reduce-scatter per unit. ``MeshModel`` then shares the loss: one
      all-reduce on ``pp`` and one on ``shard``. The activations and their
      gradients cross between stages by ``isend``/``irecv``, which
      :class:`~ddp_course.comm_cost.CollectiveLog` does not watch: not counted.

    Returns:
        ``{"forward": {...}, "backward": {...}, "loss": {...}}`` (``{"step": {...}}``
        with pipeline stages), each ``{"<collective> <dimension>": calls}``; counts
        of 0 left out.
    """
    fwd, bwd, loss = {}, {}, {}
    layers = n_layers // lay.pp
    replicate, shard = lay.shape[1], lay.shape[2]
    if lay.data == "ddp" and replicate > 1:
        bwd["all_reduce replicate"] = ddp_buckets
    if lay.data in ("fsdp", "hsdp") and shard > 1:
        units = layers + 1
        fwd["all_gather shard"] = units
        if reshard_after_forward:
            bwd["all_gather shard"] = layers
        bwd["reduce_scatter shard"] = units
    if lay.data == "hsdp" and replicate > 1:
        bwd["all_reduce replicate"] = layers + 1
    if lay.tp > 1:
        loss["all_reduce tp"] = 3
        if lay.sequence_parallel:
            fwd["all_gather tp"] = 2 * layers + 1
            fwd["reduce_scatter tp"] = 2 * layers
            bwd["all_gather tp"] = 2 * layers + 1
            bwd["reduce_scatter tp"] = 2 * layers + 1
            bwd["all_reduce tp"] = 2 * (2 * layers + 1)
        else:
            fwd["all_reduce tp"] = 2 * layers
            bwd["all_reduce tp"] = 4 * layers + 1
    if lay.pp == 1:
        return {"forward": fwd, "backward": bwd, "loss": loss}
    if lay.tp > 1 or lay.data != "fsdp":
        raise ValueError("the pipeline formula covers pp x fsdp only")
    step = {"all_reduce pp": 1}
    if shard > 1:
        # The root once; with resharding, each block per micro-batch and once in backward.
        gathers = 1 + (microbatches + 1) * layers if reshard_after_forward else layers + 1
        step["all_gather shard"] = gathers
        step["reduce_scatter shard"] = layers + 1
        step["all_reduce shard"] = 1
    return {"step": step}


def comm_debug_counts(mode, dimension: str = "tp") -> dict[str, int]:
    """``CommDebugMode`` counts of DTensor's functional collectives, keyed like
    :func:`expected_collectives` (``"all_reduce tp"``), all on ``dimension`` (DTensor's
    collectives here are tensor parallelism's). FSDP2's ``c10d`` calls are left out:
    :class:`ddp_course.comm_cost.CollectiveLog` logs those.
    """
    out = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op)
        if "functional" not in name:
            continue
        short = name.split(".")[-1].removesuffix("_into_tensor").removesuffix("_tensor")
        out[f"{short} {dimension}"] = out.get(f"{short} {dimension}", 0) + n
    return out


@dataclasses.dataclass
class BucketCounter:
    """DDP's bucket all-reduces per phase, filled by the hook of :func:`count_ddp_buckets`.

    Set :attr:`phase` before the work; :attr:`counts` gets
    ``{phase: {"all_reduce replicate": calls}}`` (nothing while ``phase`` is None).
    """

    phase: str | None = None
    counts: dict = dataclasses.field(default_factory=dict)


def count_ddp_buckets(ddp: torch.nn.Module) -> BucketCounter:
    """Count the all-reduce of each DDP gradient bucket (a communication hook).

    The hook is PyTorch's ``allreduce_hook`` (divide by the group size, then sum),
    which gives DDP's own average (exactly, for a power-of-two group size), plus
    a count. Register it before the first backward, once per DDP module.

    Returns:
        The counter the hook fills.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter = BucketCounter()

    def hook(group, bucket):
        if counter.phase is not None:
            per = counter.counts.setdefault(counter.phase, {})
            per["all_reduce replicate"] = per.get("all_reduce replicate", 0) + 1
        return allreduce_hook(group, bucket)

    ddp.register_comm_hook(ddp.process_group, hook)
    return counter


def count_step(mm, x: torch.Tensor, y: torch.Tensor, buckets: BucketCounter | None = None):
    """One training step of a ``MeshModel`` with its collectives counted per phase.

    The same gradients and loss as ``mm.forward_backward(x, y)``: without a
    pipeline, forward, loss and backward run as three phases (under
    ``loss_parallel()`` with tensor parallelism); with one, the whole step is the
    phase ``"step"``.

    Args:
        mm: a :class:`ddp_course.mesh_layouts.MeshModel`.
        x, y: this rank's slice, ``int64 [B/dp, T]``.
        buckets: the DDP layout's :func:`count_ddp_buckets` counter.

    Returns:
        ``(loss, {phase: {"<collective> <dimension>": calls}})``; the loss as
        ``forward_backward`` returns it.
    """
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    from .comm_cost import CollectiveLog

    log, seen = CollectiveLog(mm.mesh), {}
    if mm.schedule is not None:
        # No CommDebugMode: its module tracker fails inside the pipeline's stages (torch
        # 2.13), and pp x fsdp makes no DTensor collective.
        with log.recording("step"):
            value = mm.forward_backward(x, y)
        return value, {"step": log.counts("step")}
    with loss_parallel() if mm.loss_parallel else contextlib.nullcontext():
        for phase in ("forward", "loss", "backward"):
            if buckets is not None:
                buckets.phase = phase
            with log.recording(phase), CommDebugMode() as mode:
                if phase == "forward":
                    with mm.autocast():
                        logits = mm.module(x)
                elif phase == "loss":
                    with mm.autocast():
                        loss = mm.cross_entropy(logits, y)
                else:
                    loss.backward()
            seen[phase] = log.counts(phase) | comm_debug_counts(mode)
            if buckets is not None:
                seen[phase] |= buckets.counts.pop(phase, {})
                buckets.phase = None
    local = loss.detach()
    local = (local.full_tensor() if hasattr(local, "full_tensor") else local).to(torch.float64)
    for group in mm.dp_groups:
        dist.all_reduce(local, group=group)
    return (local / mm.layout.dp).item(), seen
