"""A training step's memory, measured: the allocator's peak (lesson 14).

:func:`measured_step_bytes` is what :meth:`ddp_course.step_budget.StepBudget.check`
checks a predicted budget against: the state held before a step and the
allocator's peak during it, read from CUDA's allocator on a GPU and from the
profiler's memory events on a CPU (:func:`profiled_peak_bytes`). What a step
saves for backward is counted apart, by ``ddp_course.tools.saved_tensors``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["measured_step_bytes", "profiled_peak_bytes"]


def profiled_peak_bytes(fn: Callable[[], object]) -> int:
    """The CPU allocator's peak during ``fn()``, bytes above what was allocated before.

    Runs ``fn`` under ``torch.profiler.profile(profile_memory=True)``
    (https://pytorch.org/docs/stable/profiler.html) and adds up, in time
    order, the bytes each recorded operator allocated and freed itself
    (``self_cpu_memory_usage``; a free is negative). An allocation and a free
    inside one operator cancel, so this is a lower bound of the true peak at
    operator granularity. On a GPU use ``torch.cuda.max_memory_allocated``.
    """
    from torch.profiler import ProfilerActivity, profile

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
    held += size(v for s in optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.device == device)  # fmt: skip
    if device.type != "cuda":
        return held + profiled_peak_bytes(step)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return held + torch.cuda.max_memory_allocated(device) - base
