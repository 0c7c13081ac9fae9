"""Which link a timed sweep measures: one device plan for every world size, and its label.

An alpha-beta line fitted through timings at N = 2, 3, 4 (:mod:`.cost_models`)
describes one link only if every N ran on the same device and backend;
:func:`sweep_device_plan` makes that plan and :func:`link_label` names the link, for
a plot's title or a table.
"""

from __future__ import annotations

from collections.abc import Sequence

from ... import runtime

__all__ = ["link_label", "sweep_device_plan"]


def sweep_device_plan(world_sizes: Sequence[int], gpus: int | None = None) -> runtime.DevicePlan:
    """One device plan for every launch of a sweep over world sizes.

    An alpha-beta line fitted through timings at N = 2, 3, 4 describes one
    link only if every N ran on the same device and backend. Planning each
    launch on its own would put N = 2 on two GPUs with nccl and N = 3, 4 on
    the CPU with gloo on a 2-GPU machine. So the plan is made once, for the
    largest N (:func:`ddp_course.runtime.device_plan`): CUDA and nccl for all
    of the sweep when that N fits the GPUs, else the CPU and gloo for all of
    it. Pass ``{runtime.DEVICE_ENV: plan.device_type}`` as ``env`` to every
    ``launch.torchrun`` of the sweep.

    Args:
        world_sizes: the ranks of each launch, each >= 1, at least one.
        gpus: GPUs on this machine; default :func:`ddp_course.runtime.gpu_count`.

    Returns:
        The :class:`ddp_course.runtime.DevicePlan` of ``max(world_sizes)`` ranks.

    Raises:
        ValueError: no world sizes, a world size < 1, or ``gpus`` < 0.
    """
    sizes = list(world_sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"need at least one world size, each >= 1, not {sizes}")
    return runtime.device_plan(max(sizes), runtime.gpu_count() if gpus is None else gpus)


def link_label(backend: str, device: str) -> str:
    """What carried the bytes of a run on ``backend`` and ``device``, in a few words.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (a results file's ``backend``).
        device: ``"cpu"`` or ``"cuda:<i>"`` (its ``device``).

    Returns:
        e.g. ``"loopback TCP between processes (gloo, CPU)"``.

    Raises:
        ValueError: a backend other than gloo and nccl.
    """
    on_gpu = device.split(":")[0] == "cuda"
    if backend == "nccl":
        return "GPU to GPU over NVLink or PCIe (nccl)"
    if backend == "gloo":
        if on_gpu:
            return "TCP between processes, CUDA tensors staged through host memory (gloo)"
        return "loopback TCP between processes (gloo, CPU)"
    raise ValueError(f"no link label for backend {backend!r}")
