"""What each layout of TinyGPT should hold and run, from the layout alone (notebook 13).

:func:`expected_memory_bytes` gives the bytes of parameters, gradients and AdamW state one
rank holds (the ZeRO rule), :func:`expected_collectives` how many all-gathers,
reduce-scatters, all-reduces, broadcasts, sends and receives one training step makes on
each mesh dimension. Notebook 13 checks both against what a step measures
(:mod:`ddp_course.tools.mesh_counts`). :func:`saved_block_bytes_formula` gives the bytes
one rank's from-scratch tensor-parallel block
(:class:`ddp_course.sequence_parallel.ParallelBlock`) saves for backward, with and
without sequence parallelism, which notebook 13 compares with the bytes counted
(:func:`ddp_course.tools.saved_tensors.saved_activation_bytes`).
"""

from __future__ import annotations

from .mesh_layouts import Layout
from .mesh_model import split_stages
from .models import TinyGPT

__all__ = ["expected_collectives", "expected_memory_bytes", "saved_block_bytes_formula"]


def expected_collectives(
    lay,
    n_layers: int,
    reshard_after_forward: bool = True,
    microbatches: int = 2,
    ddp_buckets: int = 1,
    rebuilt_buckets: bool = True,
    stage: int = 0,
) -> dict:
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
      ``bucket_cap_mb`` = 25 MiB each; TinyGPT fits in one). After the first
      backward DDP rebuilds its buckets in the order the gradients arrived and
      tells every rank that order: with ``rebuilt_buckets`` (the second step)
      its forward starts with 2 broadcasts (the bucket sizes and the parameter
      indices; PyTorch's ``_sync_bucket_indices``);
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
      all-reduce on ``pp`` and one on ``shard``. Each micro-batch's activations
      go to the next stage and their gradients come back, one send and one
      receive each: a ``stage`` that is not the last sends ``microbatches``
      activations and receives as many gradients, one that is not the first
      receives the activations and sends the gradients. With tensor parallelism in
      the stages (no sequence parallelism) each micro-batch makes the ``tp``
      all-reduces above (``2 L/pp`` forward, ``4 L/pp`` backward, one more for the
      head's input on the last stage), and the last stage all-gathers its logits
      whole over ``tp``: inside a pipeline the loss is not vocabulary-parallel
      (:class:`~ddp_course.mesh_model.MeshModel` says why), so no loss all-reduces.

    Raises:
        ValueError: pipeline stages with DDP, HSDP or sequence parallelism (not modelled).

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
        if rebuilt_buckets:
            fwd["broadcast replicate"] = 2
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
    if lay.data != "fsdp" or lay.sequence_parallel:
        raise ValueError("the pipeline formula covers pp x fsdp and pp x tp (no sp) only")
    neighbours = (stage < lay.pp - 1) + (stage > 0)
    step = {
        "all_reduce pp": 1,
        "send pp": microbatches * neighbours,
        "recv pp": microbatches * neighbours,
    }
    if lay.tp > 1:
        last = stage == lay.pp - 1
        step["all_reduce tp"] = microbatches * (6 * layers + last)
        if last:
            step["all_gather tp"] = microbatches  # the logits, gathered for the plain loss
    if shard > 1:
        # The root once; with resharding, each block per micro-batch and once in backward.
        gathers = 1 + (microbatches + 1) * layers if reshard_after_forward else layers + 1
        step["all_gather shard"] = gathers
        step["reduce_scatter shard"] = layers + 1
        step["all_reduce shard"] = 1
    return {"step": step}


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


def saved_block_bytes_formula(
    batch: int,
    seq: int,
    d_model: int,
    heads: int,
    world_size: int,
    sequence_parallel: bool,
    element_size: int = 8,
    mask_size: int | None = None,
) -> int:
    """Bytes one rank's tensor-parallel block saves for backward (dropout > 0, ``flash=False``).

    The block is :class:`ddp_course.sequence_parallel.ParallelBlock`.

    Korthikanti et al. 2022, section 4 and table 2, count per layer, with
    s = T, b = B, h = d, a heads, t = N, 2-byte activations and 1-byte
    dropout masks: ``sbh(10 + 24/t) + 5as²b/t`` under tensor parallelism and
    ``sbh·34/t + 5as²b/t`` with sequence parallelism. With ``e``-byte
    activations and ``m``-byte masks the same terms are: replicated
    ``sbh(4e + 2m)`` (the inputs of the two LayerNorms, of q/k/v and of fc1;
    two dropout masks), split ``12e·sbh`` (q, k, v, the projection's input;
    GELU's input, fc2's input) and ``(2e + m)as²b`` (softmax output, its
    dropout mask and output), and, not in the paper, the LayerNorms' mean
    and reciprocal standard deviation ``4e·sb`` (replicated) and the causal
    mask, ``s²`` bytes (bool, the same for every sample). Sequence
    parallelism divides the replicated terms by t as well. With e = 2, m = 1
    the sbh terms are the paper's 10 + 24/t and 34/t.

    Args:
        element_size: bytes per activation element (8 for float64).
        mask_size: bytes per dropout-mask element: 1 where dropout runs
            PyTorch's fused kernel (CUDA: a bool mask); on the CPU dropout
            multiplies by a scaled mask in the activations' dtype, so the
            default is ``element_size``.

    Returns:
        Bytes per rank, to compare with what
        ``ddp_course.tools.saved_tensors.saved_activation_bytes`` counts.
    """
    e, t = element_size, world_size
    m = e if mask_size is None else mask_size
    sbh, as2b, sb = seq * batch * d_model, heads * seq * seq * batch, seq * batch
    replicated = (4 * e + 2 * m) * sbh + 4 * e * sb
    split = 12 * e * sbh + (2 * e + m) * as2b
    if sequence_parallel and t > 1:
        return (replicated + split) // t + seq * seq
    return replicated + split // t + seq * seq
