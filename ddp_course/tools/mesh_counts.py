"""What a layout's training step holds, runs and takes, measured on this rank (notebook 13).

:func:`count_step` runs one step of a :class:`~ddp_course.mesh_model.MeshModel` with its
collectives counted per phase and mesh dimension by the course's one collective log
(:class:`~ddp_course.tools.collective_log.CollectiveLog`), which sees FSDP2's calls,
DTensor's functional collectives (tensor parallelism), the bucket all-reduces DDP's C++
reducer issues and the pipeline's sends and receives alike; :func:`counted_step` does it
for one step inside :func:`ddp_course.mesh_runs.train`, :func:`count_kept_gathered` for
FSDP x TP keeping its gathered parameters. :func:`memory_row` adds up the bytes a rank
holds after one AdamW step of a layout.
:mod:`ddp_course.mesh_predictions` says what both should be. :func:`synced_clock` reads the
time once a GPU has done its work; :func:`speed` turns step times into tokens/s and
:func:`mfu_fields` into MFU (:mod:`ddp_course.tools.flops`).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from .. import mesh_layouts as ml
from .. import mesh_predictions as predict
from ..mesh_model import MeshModel
from ..mesh_runs import adamw, my_slice, new_model
from . import flops
from .collective_log import CollectiveLog
from .zero_counts import held_state_bytes

__all__ = [
    "count_kept_gathered",
    "count_step",
    "counted_step",
    "memory_row",
    "mfu_fields",
    "speed",
    "synced_clock",
]


def count_step(mm, x: torch.Tensor, y: torch.Tensor):
    """One training step of a ``MeshModel`` with its collectives counted per phase.

    The same gradients and loss as ``mm.forward_backward(x, y)``: without a
    pipeline, forward, loss and backward run as three phases (under
    ``loss_parallel()`` with tensor parallelism); with one, the whole step is the
    phase ``"step"``. One :class:`~ddp_course.tools.collective_log.CollectiveLog`,
    given the mesh, sees every collective whatever issued it: FSDP2's, DTensor's,
    DDP's reducer's and the pipeline's sends and receives.

    Args:
        mm: a :class:`ddp_course.mesh_model.MeshModel`.
        x, y: this rank's slice, ``int64 [B/dp, T]``.

    Returns:
        ``(loss, {phase: {"<collective> <dimension>": calls}})``; the loss as
        ``forward_backward`` returns it.
    """
    from torch.distributed.tensor.parallel import loss_parallel

    log, seen = CollectiveLog(mm.mesh), {}
    if mm.schedule is not None:
        with log.recording("step"):
            value = mm.forward_backward(x, y)
        return value, {"step": log.counts("step")}
    with loss_parallel() if mm.loss_parallel else contextlib.nullcontext():
        for phase in ("forward", "loss", "backward"):
            with log.recording(phase):
                if phase == "forward":
                    with mm.autocast():
                        logits = mm.module(x)
                elif phase == "loss":
                    with mm.autocast():
                        loss = mm.cross_entropy(logits, y)
                else:
                    loss.backward()
            seen[phase] = log.counts(phase)
    local = loss.detach()
    local = (local.full_tensor() if hasattr(local, "full_tensor") else local).to(torch.float64)
    for group in mm.dp_groups:
        dist.all_reduce(local, group=group)
    return (local / mm.layout.dp).item(), seen


def counted_step(counts: dict, at: int = 1):
    """A ``step_fn`` for :func:`ddp_course.mesh_runs.train` that counts step ``at``'s
    collectives (:func:`count_step`) into ``counts``; the other steps run uncounted. The
    second step (``at=1``) is the steady one: the first also builds communicators and
    DDP's buckets."""

    def step(mm, i: int, x: torch.Tensor, y: torch.Tensor) -> float:
        if i != at:
            return mm.forward_backward(x, y)
        loss, seen = count_step(mm, x, y)
        counts.update(seen)
        return loss

    return step


def memory_row(lay: ml.Layout, mm, ctx, config: dict, dtype: torch.dtype, batch, lr: float) -> dict:
    """Bytes this rank holds after one AdamW step of ``mm`` on its slice of ``batch``,
    measured (:func:`~ddp_course.tools.zero_counts.held_state_bytes` with
    ``per_tensor=True``: lesson 13's formulas count the elements of each shard, while FSDP2
    keeps a shard in a buffer padded to an even split; parameters, gradients, AdamW's two
    states, its ``"steps"`` left out, as the formula leaves them out) and from
    :func:`~ddp_course.mesh_predictions.expected_memory_bytes`.

    Returns:
        ``{"layout", "rank", "held": {"params", "grads", "optimizer"}, "formula": the same
        keys}``, in bytes.
    """
    opt = adamw(mm.module.parameters(), lr)
    mm.forward_backward(*my_slice(batch, mm.mesh, lay.dp))
    opt.step()
    held = held_state_bytes(mm.module.parameters(), opt, per_tensor=True)
    del held["steps"]  # 4 bytes a tensor, not in expected_memory_bytes
    whole = new_model(config, dtype, ctx.device, 0)  # the unsplit shapes, for the formula
    formula = predict.expected_memory_bytes(whole, lay, dtype.itemsize, mm.stage_index)
    return {"layout": lay.name, "rank": ctx.rank, "held": held, "formula": formula}


def count_kept_gathered(ctx, config: dict, dtype: torch.dtype, batch) -> dict:
    """Collectives of one steady FSDP x TP step with ``reshard_after_forward=False``: the
    blocks keep their gathered parameters for backward (fewer all-gathers, more memory).

    Returns:
        ``{"measured": rank 0's counts of the second step, "formula": expected_collectives'}``,
        each ``{phase: {"<collective> <dimension>": calls}}``.
    """
    lay = ml.layout("fsdp x tp", ctx.world_size)
    mesh = ml.build_mesh(lay, ctx.device.type)
    mm = MeshModel(new_model(config, dtype, ctx.device, 0), lay, mesh, reshard_after_forward=False)
    for _ in range(2):  # the second step is the steady one
        _, seen = count_step(mm, *my_slice(batch, mesh, lay.dp))
        mm.module.zero_grad()
    return {
        "measured": seen,
        "formula": predict.expected_collectives(lay, config["n_layers"], False),
    }


def synced_clock(device: torch.device) -> float:
    """Seconds now (``time.perf_counter``), once ``device`` has done its queued work: a GPU
    runs asynchronously, so without ``torch.cuda.synchronize`` a step's time would be the
    time to queue it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def speed(step_seconds: list[float], warmup: int, tokens_per_step: int) -> dict:
    """Tokens per second over the steps after the first ``warmup`` ones (those build
    communicators and fill caches).

    Args:
        step_seconds: every step's seconds.
        warmup: steps left out, >= 0.
        tokens_per_step: tokens of one global batch (sequences x length).

    Returns:
        ``{"timed_steps", "seconds": their sum or None, "tokens_per_s": or None,
        "median_step_s"}``; with no step left after the warm-up, ``"tokens_per_s_skipped"``
        (why) in place of ``"median_step_s"``.
    """
    timed = step_seconds[warmup:]
    if not timed:
        why = f"{len(step_seconds)} steps leave none after --warmup {warmup}"
        return {
            "timed_steps": 0,
            "seconds": None,
            "tokens_per_s": None,
            "tokens_per_s_skipped": why,
        }
    seconds = sum(timed)
    return {
        "timed_steps": len(timed),
        "seconds": seconds,
        "tokens_per_s": len(timed) * tokens_per_step / seconds,
        "median_step_s": statistics.median(timed),
    }


def mfu_fields(
    tokens_per_s: float | None,
    world_size: int,
    gpu: str,
    dtype: str,
    peak_flops: float | None,
    flops_per_token: float,
) -> dict:
    """The MFU of a run (:func:`ddp_course.tools.flops.mfu`) or why it is skipped.

    Args:
        tokens_per_s: the job's tokens per second (``None``: no step was timed).
        world_size: GPUs of the job: each does ``1/world_size`` of the tokens.
        gpu: the exact device name (``""`` on a CPU).
        dtype: the run's ``--dtype``.
        peak_flops: the GPU's dense bfloat16 peak in FLOP/s, or ``None`` to look it up.
        flops_per_token: :func:`ddp_course.tools.flops.flops_per_token` of the model.

    Returns:
        ``{"mfu", "flops_per_token", "peak_flops"}``, or ``{"mfu_skipped": why}``.
    """
    peak = peak_flops or (flops.peak_bf16_flops(gpu) if gpu else None)
    why = flops.skip_reason(gpu, dtype, peak_flops)
    if why is None and tokens_per_s is None:
        why = "MFU skipped: no step was timed"
    if why is not None:
        return {"mfu_skipped": why}
    return {
        "mfu": flops.mfu(flops_per_token, tokens_per_s / world_size, peak),
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
    }
