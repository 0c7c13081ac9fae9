"""Process-level runtime: who am I, which device and backend, and a process
group that is always torn down.

Everything here reads the environment variables that ``torchrun`` sets
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; see https://pytorch.org/docs/stable/elastic/run.html) and
falls back to a single process when they are absent, so one script runs both
as ``python script.py`` and as ``torchrun --nproc_per_node=N script.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import random
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from .harness import loopback, restarts

__all__ = [
    "DEVICE_ENV",
    "DevicePlan",
    "DistContext",
    "barrier",
    "device_for_rank",
    "device_plan",
    "distributed",
    "get_logger",
    "gpu_count",
    "no_tf32",
    "pick_backend",
    "pick_device",
    "require_group",
    "rank0_first",
    "replica_devices",
    "seed_everything",
]


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job; passed explicitly, never global.

    Attributes:
        rank: global rank, 0 <= rank < world_size.
        local_rank: rank on this node; indexes the node's GPUs.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        device: the device this process computes on (``cuda:<local_rank>``
            or ``cpu``).
        backend: the process-group backend (``"nccl"`` or ``"gloo"``), or
            ``None`` when no process group was created.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints, saves and writes results."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group exists and collectives may be called."""
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


# Set by ddp_course.harness.launch.torchrun for every worker: "cuda" or "cpu", the
# device type of the plan it chose (see device_plan). A learner may set it too,
# e.g. DDP_COURSE_DEVICE=cpu torchrun --nproc_per_node=4 script.py on a 1-GPU box.
DEVICE_ENV = "DDP_COURSE_DEVICE"
# Seconds a gloo rank releases the GIL before its group is destroyed (see
# _let_gloo_workers_finish); short beside any job, long beside a thread switch.
GLOO_RELEASE_S = 0.05
GLOO_RELEASE_ENV = "DDP_COURSE_GLOO_RELEASE_S"


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Where the ranks of one node run, decided once for the whole job.

    Attributes:
        device_type: ``"cuda"`` (one GPU per local rank) or ``"cpu"``.
        backend: ``"nccl"`` with CUDA, ``"gloo"`` on CPU.
        reason: one line for a learner, e.g. ``"2 ranks, 1 GPU: running on
            CPU with gloo so every rank has a device"``.
        fallback: True when the node has GPUs but the plan leaves them unused.
    """

    device_type: str
    backend: str
    reason: str
    fallback: bool = False


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def device_plan(nproc_per_node: int, gpu_count: int) -> DevicePlan:
    """The course's device rule: CUDA and nccl only when every local rank gets its own GPU.

    With fewer GPUs than ranks (a laptop, a one-GPU cloud notebook running a
    2-rank lesson) the whole job runs on CPU with gloo, so the lesson still
    runs (nccl expects one GPU per rank, and the course's scripts map local
    rank ``r`` to ``cuda:r``).

    Args:
        nproc_per_node: ranks (processes) on this node, at least 1.
        gpu_count: GPUs visible on this node (``torch.cuda.device_count()``).

    Returns:
        A :class:`DevicePlan`; a pure function of its arguments.

    Raises:
        ValueError: ``nproc_per_node`` < 1 or ``gpu_count`` < 0.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be at least 1, not {nproc_per_node}")
    if gpu_count < 0:
        raise ValueError(f"gpu_count cannot be negative, not {gpu_count}")
    ranks, gpus = _plural(nproc_per_node, "rank"), _plural(gpu_count, "GPU")
    if gpu_count == 0:
        return DevicePlan("cpu", "gloo", f"{ranks}, no GPU: running on CPU with gloo")
    if nproc_per_node <= gpu_count:
        return DevicePlan("cuda", "nccl", f"{ranks}, {gpus}: one GPU per rank with nccl")
    reason = f"{ranks}, {gpus}: running on CPU with gloo so every rank has a device"
    return DevicePlan("cpu", "gloo", reason, fallback=True)


def device_for_rank(local_rank: int, gpu_count: int, planned: str | None = None) -> torch.device:
    """The device of one local rank, given the GPU count and the launcher's plan.

    Args:
        local_rank: rank on this node, >= 0.
        gpu_count: GPUs visible to this process.
        planned: ``"cpu"``, ``"cuda"`` or ``None`` (no plan: plain
            ``torchrun`` or ``python``), usually read from ``DDP_COURSE_DEVICE``.

    Returns:
        ``cuda:<local_rank>`` or ``cpu``. Without a plan: CUDA whenever there
        is a GPU, CPU otherwise.

    Raises:
        RuntimeError: CUDA is asked for (or there is no plan and there are
            GPUs) but ``local_rank`` has no GPU of its own; the message says
            how many processes fit, or how to run on CPU instead.
        ValueError: ``planned`` is not ``"cpu"``, ``"cuda"`` or ``None``.
    """
    if planned not in (None, "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', not {planned!r}")
    if planned == "cpu" or (planned is None and gpu_count == 0):
        return torch.device("cpu")
    if local_rank >= gpu_count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this node has {gpu_count}. "
            f"Use --nproc_per_node={gpu_count} or fewer, or run every rank on CPU "
            f"with {DEVICE_ENV}=cpu."
        )
    return torch.device("cuda", local_rank)


def gpu_count() -> int:
    """GPUs this process can use: ``torch.cuda.device_count()``, 0 without CUDA.

    Every device decision in the course reads the count through this function
    (tests patch it to play a machine with 0, 1, 2 or 4 GPUs).
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_count() -> int:
    return gpu_count()


def replica_devices(num_replicas: int | None, gpus: int) -> list[torch.device]:
    """The devices of single-process DataParallel's replicas, by the course's device rule.

    One GPU per replica when there are enough (``cuda:0`` .. ``cuda:n-1``, as
    ``nn.DataParallel(device_ids=range(n))``), otherwise every replica on the
    CPU (threads of one process), as :func:`device_plan` does for ranks: a
    replica never shares a GPU with another.

    Args:
        num_replicas: replicas wanted; ``None``: one per GPU, or 2 without GPUs.
        gpus: GPUs visible (:func:`gpu_count`).

    Returns:
        ``num_replicas`` devices; the module must live on the first.

    Raises:
        ValueError: ``num_replicas`` < 1 or ``gpus`` < 0.
    """
    if gpus < 0:
        raise ValueError(f"gpus cannot be negative, not {gpus}")
    n = num_replicas if num_replicas is not None else (gpus or 2)
    if n < 1:
        raise ValueError(f"num_replicas must be at least 1, not {n}")
    if 0 < n <= gpus:
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu")] * n


def no_tf32() -> None:
    """Make float32 matmuls and cuDNN convolutions compute in full float32.

    On Ampere and newer GPUs torch may use TensorFloat-32 (10-bit mantissa)
    for float32 work: off for matmuls, on for cuDNN convolutions by default
    (https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices).
    A run compared with a reference to 1e-5 must not round to 1e-3 on one
    side only, so every equivalence check calls this on both sides. Uses the
    ``fp32_precision`` settings of torch >= 2.9, the ``allow_tf32`` flags
    before that; a no-op for the CPU.
    """
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv"):
        matmul.fp32_precision = "ieee"
        cudnn.conv.fp32_precision = "ieee"
    else:  # torch < 2.9
        matmul.allow_tf32 = False
        cudnn.allow_tf32 = False


def pick_device(local_rank: int = 0) -> torch.device:
    """The device for a process: ``cuda:<local_rank>`` when CUDA is usable, else CPU.

    Follows the launcher's plan in ``DDP_COURSE_DEVICE`` when it is set
    (``cpu`` runs on CPU even on a GPU machine), otherwise the rule without a
    plan; see :func:`device_for_rank`.

    Raises:
        RuntimeError: if there are GPUs but fewer than ``local_rank + 1``
            (and no plan says ``cpu``); launch at most
            ``torch.cuda.device_count()`` processes per node.
        ValueError: ``DDP_COURSE_DEVICE`` is neither ``cpu`` nor ``cuda``.
    """
    return device_for_rank(local_rank, _gpu_count(), os.environ.get(DEVICE_ENV) or None)


def pick_backend(device: torch.device) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` for CPU.

    Chosen from the device, not from ``dist.is_nccl_available()``: that is
    True on CPU-only builds that ship NCCL, where nccl cannot run.
    """
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def distributed(
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout_s: float | None = None,
    group_of_one: bool = False,
) -> Iterator[DistContext]:
    """Set the device, create the default process group and always destroy it.

    Under ``torchrun`` (``WORLD_SIZE`` set) this calls
    ``dist.init_process_group`` with the ``env://`` variables (on the agent's
    store, with a key prefix per restart attempt, so ``--max-restarts``
    restarts cleanly); as a plain
    ``python`` process it creates no group and yields a single-process
    context, so the same script runs both ways.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``"mpi"``; default from the device.
        device: override the device (e.g. ``"cpu"`` to run gloo on a GPU box).
            ``None``: the plan of the launcher (``DDP_COURSE_DEVICE``, set by
            :func:`ddp_course.harness.launch.torchrun`) if any, else :func:`pick_device`.
        timeout_s: collective timeout in seconds; a short one turns a hang
            (mismatched collectives, uneven inputs) into an error.
        group_of_one: as a plain ``python`` process, still create a process
            group, of one rank over an in-memory store (the device's
            backend unless ``backend`` says otherwise: nccl on a GPU, gloo
            on the CPU), so code that calls collectives or
            wraps a model in DDP runs unchanged with world size 1.

    Yields:
        The :class:`DistContext` of this process.

    Raises:
        RuntimeError: if the environment names a world size but no rank, or
            the rank does not fit the world size, or this local rank has no
            GPU of its own (see :func:`device_for_rank`).
        ValueError: ``DDP_COURSE_DEVICE`` is neither ``cpu`` nor ``cuda``.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    in_launcher = "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if in_launcher and "RANK" not in os.environ:
        raise RuntimeError("WORLD_SIZE is set but RANK is not: launch with torchrun")
    if not 0 <= rank < world_size:
        raise RuntimeError(f"RANK={rank} does not fit WORLD_SIZE={world_size}")

    dev = torch.device(device) if device is not None else pick_device(local_rank)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    name = None
    server = None  # rank 0's store server on loopback, kept as long as the group
    if in_launcher:
        name = backend or pick_backend(dev)
        kwargs = {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if name == "nccl":
            kwargs["device_id"] = dev
        store = restarts.attempt_store(kwargs.get("timeout"))
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world_size)
        elif rank == 0 and "MASTER_PORT" in os.environ:
            # Without torchrun's agent store, rank 0's env:// store would listen on every
            # interface, whatever MASTER_ADDR says; on a loopback address keep it there.
            server = loopback.serve_on_loopback(
                os.environ.get("MASTER_ADDR", ""), int(os.environ["MASTER_PORT"])
            )
        dist.init_process_group(backend=name, **kwargs)
    elif group_of_one:
        name = backend or pick_backend(dev)
        extra = {"device_id": dev} if name == "nccl" else {}
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, **extra)
    ctx = DistContext(rank, local_rank, world_size, local_world_size, dev, name)
    try:
        yield ctx
    except Exception as exc:
        if in_launcher:
            restarts.report_failure(rank, exc)
        raise
    finally:
        if dist.is_initialized():
            # gloo workers that built a DDP model abort at exit now and then
            # unless the reducer's references are collected before the group
            # goes away (measured: 4 aborts in 12 runs without this, 0 in 24).
            gc.collect()
            if name == "gloo":
                _let_gloo_workers_finish()
            dist.destroy_process_group()
        del server  # after the group: its store may still have used the server


def _let_gloo_workers_finish() -> None:
    """Release the GIL for :data:`GLOO_RELEASE_S` seconds (``DDP_COURSE_GLOO_RELEASE_S``
    overrides it; ``0`` shows the deadlock) so gloo's worker threads finish their last work.

    A gloo work that finished may still be freed by the worker thread that ran it,
    and freeing tensors that Python created takes the GIL. ``ProcessGroupGloo``'s
    destructor joins those threads while holding the GIL (it runs when the last
    reference to the group goes, often DDP's reducer as ``main()`` returns), so a
    worker still waiting for the GIL then deadlocks the rank: seen in 1 of 62
    runs of lesson 12's monitor job with ranks forked from torchrun's agent
    (py-spy: the main thread in ``~ProcessGroupGloo``/``thread::join``, a worker in
    ``~AsyncGatherWork`` waiting for the GIL). A sleep hands the GIL to the worker:
    no hang in 110 runs with it (``benchmarks/gloo_teardown.py`` counts both ways).
    """
    time.sleep(float(os.environ.get(GLOO_RELEASE_ENV, GLOO_RELEASE_S)))


def require_group(
    group: dist.ProcessGroup | None = None, needed_for: str = "this"
) -> dist.ProcessGroup:
    """The process group to use: ``group``, or the world's when it is None.

    The one check every mechanism makes before its first collective, so that a
    script run without a process group stops with what to do instead of torch's
    "Default process group has not been initialized".

    Args:
        group: a process group, or None for the default (world) group.
        needed_for: what needs it, for the message (e.g. ``"tensor parallelism"``).

    Raises:
        RuntimeError: if no process group exists (``init_process_group`` was never
            called), naming ``needed_for`` and what to call first.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{needed_for} needs a process group: call "
            "torch.distributed.init_process_group() first, or run the script with torchrun "
            "inside ddp_course.runtime.distributed() (with distributed() as ctx: ...)"
        )
    return group if group is not None else dist.group.WORLD


def barrier(ctx: DistContext) -> None:
    """``dist.barrier()`` when distributed; a no-op for a single process."""
    if ctx.is_distributed:
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


@contextlib.contextmanager
def rank0_first(ctx: DistContext) -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks.

    For work that must happen once before anyone else reads its result,
    such as unpacking a data set into a shared folder.
    """
    if not ctx.is_main:
        barrier(ctx)
    yield
    if ctx.is_main:
        barrier(ctx)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        record.world_size = self.world_size
        return True


def get_logger(ctx: DistContext, name: str = "ddp_course") -> logging.Logger:
    """A logger whose lines carry the rank: ``[rank 1/2] message``.

    Rank 0 logs at INFO, the other ranks at WARNING, so a job prints one
    copy of the routine lines and every rank's problems. Set
    ``DDP_COURSE_LOG_ALL_RANKS=1`` to see INFO from every rank.
    """
    logger = logging.getLogger(f"{name}.rank{ctx.rank}")
    all_ranks = os.environ.get("DDP_COURSE_LOG_ALL_RANKS") == "1"
    logger.setLevel(logging.INFO if ctx.is_main or all_ranks else logging.WARNING)
    logger.propagate = False
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.addFilter(_RankFilter(ctx.rank, ctx.world_size))
        handler.setFormatter(logging.Formatter("[rank %(rank)d/%(world_size)d] %(message)s"))
        logger.addHandler(handler)
    return logger


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every GPU) with the same seed.

    Use the same seed on every rank for model initialisation and samplers;
    add the rank only where ranks must differ (augmentation, dropout).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
