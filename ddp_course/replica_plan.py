"""Which single-process data parallelism a run uses, and on which devices (lesson 02).

Lesson 02's script and notebook run either ``torch.nn.DataParallel`` or the
course's from-scratch :class:`ddp_course.data_parallel.DataParallel`.
:func:`plan_replicas` chooses between them and places the replicas by the
course's device rule (:func:`ddp_course.runtime.replica_devices`): one GPU per
replica when every replica can have its own, otherwise every replica on the
CPU as a thread. Torch's wrapper needs a GPU per replica (without GPUs it only
calls the model), so asking for it where the rule gives CPU threads is refused
with a message that names the from-scratch version.
"""

from __future__ import annotations

import dataclasses

import torch

from . import runtime

__all__ = ["ReplicaPlan", "plan_replicas"]


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """Which single-process data parallelism runs, and on which devices.

    Attributes:
        impl: ``"torch"`` (``torch.nn.DataParallel``) or ``"scratch"``
            (:class:`ddp_course.data_parallel.DataParallel`).
        devices: one device per replica; the model and the batches go to
            ``devices[0]``.
        reason: one line for a learner, e.g. ``"3 replicas, 2 GPUs: CPU
            threads, so that no GPU is shared by two replicas"``.
    """

    impl: str
    devices: list[torch.device]
    reason: str


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def plan_replicas(impl: str, num_replicas: int | None, gpus: int | None = None) -> ReplicaPlan:
    """Choose the implementation and the devices of a one-process DataParallel run.

    The devices are :func:`ddp_course.runtime.replica_devices`: ``cuda:0`` ..
    ``cuda:n-1`` when every replica gets a GPU of its own, else ``n`` times
    ``cpu`` (threads). ``"auto"`` picks torch's wrapper on GPUs and the
    from-scratch one on the CPU, where torch's only calls the model.

    Args:
        impl: ``"auto"``, ``"torch"`` or ``"scratch"``.
        num_replicas: replicas wanted; ``None``: one per GPU, or 2 without GPUs.
        gpus: GPUs to plan for; ``None`` reads :func:`ddp_course.runtime.gpu_count`
            (pass 0 to run on the CPU on a GPU machine).

    Returns:
        A :class:`ReplicaPlan`; ``impl`` is never ``"auto"``.

    Raises:
        ValueError: ``impl`` is unknown, ``num_replicas`` < 1, or ``"torch"``
            is asked for but the replicas do not each get a GPU (no GPU at
            all, or fewer GPUs than replicas); the message names
            ``--impl scratch``, the version that runs on CPU threads.
    """
    if impl not in ("auto", "torch", "scratch"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'scratch', not {impl!r}")
    gpus = runtime.gpu_count() if gpus is None else gpus
    devices = runtime.replica_devices(num_replicas, gpus)
    n, on_gpus = len(devices), devices[0].type == "cuda"
    replicas, gpu_text = _plural(n, "replica"), _plural(gpus, "GPU") if gpus else "no GPU"
    if impl == "auto":
        impl = "torch" if on_gpus else "scratch"
    if impl == "torch" and not on_gpus:
        if gpus == 0:
            raise ValueError(
                "torch's nn.DataParallel needs GPUs: without one it only calls the model. "
                "Use --impl scratch (impl='scratch') for replicas on CPU threads."
            )
        raise ValueError(
            f"torch's nn.DataParallel over {replicas} needs one GPU per replica and there "
            f"{'is' if gpus == 1 else 'are'} {gpu_text}: ask for at most {gpus} replicas, "
            "or use --impl scratch (impl='scratch') for replicas on CPU threads."
        )
    if on_gpus:
        reason = f"{replicas}, {gpu_text}: one GPU per replica"
    elif gpus == 0:
        reason = f"{replicas}, {gpu_text}: CPU threads of one process"
    else:
        reason = f"{replicas}, {gpu_text}: CPU threads, so that no GPU is shared by two replicas"
    return ReplicaPlan(impl, devices, reason)
