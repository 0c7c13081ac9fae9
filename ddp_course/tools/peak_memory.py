"""A training step's memory, measured: the allocator's peak (lesson 14).

:func:`measured_step_bytes` is what :meth:`ddp_course.step_budget.StepBudget.check`
checks a predicted budget against: the state held before a step and the
allocator's peak during it, read from CUDA's allocator on a GPU and from the
profiler's memory events on a CPU (:func:`profiled_peak_bytes`). What a step
saves for backward is counted apart, by ``ddp_course.tools.saved_tensors``.
:class:`UnshardedPeak` reads, under FSDP2, the most bytes of full (gathered)
weights a model holds at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_course.tools.kineto_log import quiet_kineto

__all__ = ["UnshardedPeak", "measured_step_bytes", "profiled_peak_bytes"]


def profiled_peak_bytes(fn: Callable[[], object]) -> int:
    """The CPU allocator's peak during ``fn()``, bytes above what was allocated before.

    Runs ``fn`` under ``torch.profiler.profile(profile_memory=True)``
    (https://pytorch.org/docs/stable/profiler.html) and adds up, in time
    order, the bytes each recorded operator allocated and freed itself
    (``self_cpu_memory_usage``; a free is negative). An allocation and a free
    inside one operator cancel, so this is a lower bound of the true peak at
    operator granularity. On a GPU use ``torch.cuda.max_memory_allocated``.
    Kineto's start and stop lines are held back (``tools.kineto_log.quiet_kineto``).
    """
    from torch.profiler import ProfilerActivity, profile

    with quiet_kineto():  # the profiler's start and stop lines are not the step's output
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        changes = sorted(
            (ev.time_range.start, ev.self_cpu_memory_usage)
            for ev in prof.events()
            if ev.self_cpu_memory_usage
        )
    peak = live = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return peak


def measured_step_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], object]
) -> int:
    """Bytes one training step holds at its peak: the state held before it, and its peak.

    Held before: the parameters and the optimizer's state (create it with a
    first step; gradients set to None). The peak of ``step()`` (forward,
    backward, ``optimizer.step()``) above that: on a GPU
    ``torch.cuda.max_memory_allocated`` (blocks of 512 bytes or more), on a
    CPU :func:`profiled_peak_bytes` (a lower bound at operator granularity).
    Compare with :meth:`ddp_course.step_budget.StepBudget.check`.
    """

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    device = next(model.parameters()).device
    held = size(model.parameters())
    # On a GPU AdamW's step counters stay on the host: count device memory only.
    held += size(
        v
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.device == device
    )
    if device.type != "cuda":
        return held + profiled_peak_bytes(step)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return held + torch.cuda.max_memory_allocated(device) - base


class UnshardedPeak(TorchDispatchMode):
    """The most bytes of a model's parameters held unsharded at once, while it is on.

    FSDP2 registers a unit's parameters as sharded ``DTensor``s and swaps in the
    full (all-gathered) tensors while the unit computes, until it reshards
    (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html). Before
    every operator dispatched inside the ``with`` block this mode adds up
    ``numel * element_size`` of the module's registered parameters that are not
    ``DTensor``s (in the compute dtype, bfloat16 under a mixed-precision policy),
    and keeps the largest sum in :attr:`peak_bytes`. A dispatch mode follows
    autograd onto its own threads, so backward is seen on a GPU too.

    Args:
        model: the sharded module (its ``parameters()`` are read at every operator).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = sum(
            p.numel() * p.element_size()
            for p in self.model.parameters()
            if not isinstance(p, DTensor)
        )
        self.peak_bytes = max(self.peak_bytes, held)
        return func(*args, **(kwargs or {}))
