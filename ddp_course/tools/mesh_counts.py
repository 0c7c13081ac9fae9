"""What a layout's training step holds and runs, measured on this rank (notebook 13).

:func:`count_step` runs one step of a :class:`~ddp_course.mesh_model.MeshModel` with its
collectives counted per phase and mesh dimension by the course's one collective log
(:class:`~ddp_course.tools.collective_log.CollectiveLog`), which sees FSDP2's calls,
DTensor's functional collectives (tensor parallelism), the bucket all-reduces DDP's C++
reducer issues and the pipeline's sends and receives alike; :func:`tensor_bytes` adds up
the bytes of the tensors a rank holds. :mod:`ddp_course.mesh_predictions` says what both
should be.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .collective_log import CollectiveLog

__all__ = ["count_step", "tensor_bytes"]


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
