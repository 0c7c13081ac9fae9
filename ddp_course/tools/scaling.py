"""Does it scale? Speed-up, efficiency, Amdahl's and Gustafson's laws, a DDP step-time model.

- Strong scaling: a fixed global batch split over N ranks; speed-up
  ``S(N) = t(1) / t(N)`` (times of one step), efficiency ``S(N) / N``.
- Weak scaling: a fixed batch per rank; efficiency ``thr(N) / (N thr(1))``
  with throughputs in samples/s (:func:`ddp_course.tools.bench.scaling_efficiency`).
- Amdahl (1967): with a serial fraction ``s`` of one process's time,
  ``S(N) = 1 / (s + (1 - s) / N)``, at most ``1 / s`` however large N.
- Gustafson (1988): when the work grows with N (weak scaling), the scaled
  speed-up is ``S(N) = N - s (N - 1)``, linear in N.
- Step time of DDP: ``t_step = t_forward + t_backward + exposed communication
  + t_optimizer``. Buckets are all-reduced in order while backward runs (Li
  et al., "PyTorch Distributed", VLDB 2020, section 3.2.3); only the part
  of their all-reduce that outlasts backward is exposed, and only where the
  communication has hardware of its own to run on (:func:`comm_can_overlap`).
  Measured on one rank, the compute terms predict N ranks once they are
  stretched by the ranks' share of the cores (:func:`compute_slowdown`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .bench import AlphaBeta

__all__ = [
    "StepTimeModel",
    "amdahl_speedup",
    "comm_can_overlap",
    "compute_slowdown",
    "efficiency_table",
    "exposed_comm",
    "fit_amdahl",
    "fit_gustafson",
    "gustafson_speedup",
]


def _check_n(world_sizes: np.ndarray) -> None:
    if world_sizes.ndim != 1 or len(world_sizes) == 0 or np.any(world_sizes < 1):
        raise ValueError(f"world sizes must be a non-empty list of N >= 1, got {world_sizes}")


def amdahl_speedup(serial_fraction: float, world_size: float | np.ndarray) -> float | np.ndarray:
    """Amdahl's law: ``1 / (s + (1 - s) / N)`` (Amdahl, AFIPS 1967).

    Args:
        serial_fraction: s in [0, 1], the part of one process's time that
            does not parallelise (communication counts here too).
        world_size: N ranks (scalar or array).

    Raises:
        ValueError: s outside [0, 1].
    """
    if not 0 <= serial_fraction <= 1:
        raise ValueError(f"serial fraction must be in [0, 1], not {serial_fraction}")
    n = np.asarray(world_size, dtype=float)
    return 1.0 / (serial_fraction + (1 - serial_fraction) / n)


def gustafson_speedup(serial_fraction: float, world_size: float | np.ndarray) -> float | np.ndarray:
    """Gustafson's law: scaled speed-up ``N - s (N - 1)`` (Gustafson, CACM 1988).

    Raises:
        ValueError: s outside [0, 1].
    """
    if not 0 <= serial_fraction <= 1:
        raise ValueError(f"serial fraction must be in [0, 1], not {serial_fraction}")
    n = np.asarray(world_size, dtype=float)
    return n - serial_fraction * (n - 1)


def _points_beyond_one(
    world_sizes: Sequence[float], speedups: Sequence[float], law: str
) -> tuple[np.ndarray, np.ndarray]:
    # The points a fit can use: N = 1 has speed-up 1 under either law, whatever s is.
    n = np.asarray(world_sizes, dtype=float)
    sp = np.asarray(speedups, dtype=float)
    _check_n(n)
    if n.shape != sp.shape or np.any(sp <= 0):
        raise ValueError("need one positive speed-up per world size")
    keep = n > 1
    if not keep.any():
        raise ValueError(f"need a point with more than one rank to fit {law}")
    return n[keep], sp[keep]


def _slope_through_origin(x: np.ndarray, y: np.ndarray, clip: bool) -> float:
    # Least squares of y = s x; a fraction only when clipped to [0, 1].
    s = float(x @ y / (x @ x))
    return float(np.clip(s, 0.0, 1.0)) if clip else s


def fit_amdahl(world_sizes: Sequence[float], speedups: Sequence[float], clip: bool = True) -> float:
    """Serial fraction s that fits measured strong-scaling speed-ups best.

    Amdahl's law rearranged is linear in s: ``1/S - 1/N = s (1 - 1/N)``;
    least squares through the origin over the points with N > 1.

    Args:
        world_sizes: N of each point (N = 1 points carry no information).
        speedups: ``t(1) / t(N)`` of each point, > 0.
        clip: clip s to [0, 1], the range the law allows. Unclipped, s > 1
            says the runs slowed down (speed-ups below 1), which no serial
            fraction explains, and s < 0 says they beat N (super-linear):
            a fit at its bound describes the runs no better than the bound.

    Returns:
        s, clipped to [0, 1] unless ``clip`` is False.

    Raises:
        ValueError: lengths differ, no point with N > 1, or a speed-up <= 0.
    """
    n, sp = _points_beyond_one(world_sizes, speedups, "Amdahl's law")
    return _slope_through_origin(1 - 1 / n, 1 / sp - 1 / n, clip)


def fit_gustafson(
    world_sizes: Sequence[float], scaled_speedups: Sequence[float], clip: bool = True
) -> float:
    """Serial fraction s that fits measured weak-scaling (scaled) speed-ups best.

    ``N - S = s (N - 1)``, least squares through the origin over N > 1. The
    scaled speed-up is ``N * efficiency`` = ``thr(N) / thr(1)``.

    Returns:
        s, clipped to [0, 1] unless ``clip`` is False (as :func:`fit_amdahl`:
        s > 1 means the throughput fell as ranks were added).

    Raises:
        ValueError: as :func:`fit_amdahl`.
    """
    n, sp = _points_beyond_one(world_sizes, scaled_speedups, "Gustafson's law")
    return _slope_through_origin(n - 1, n - sp, clip)


def efficiency_table(
    world_sizes: Sequence[int], step_seconds: Sequence[float], kind: str, batch: int
) -> list[dict[str, float]]:
    """Throughput, speed-up and efficiency of each world size from median step times.

    Args:
        world_sizes: N of each run; must include 1 (the reference).
        step_seconds: median step time of each run, seconds.
        kind: ``"strong"``: ``batch`` is the global batch, split over the N
            ranks; ``"weak"``: ``batch`` is per rank, the global batch is N
            times it.
        batch: samples (see ``kind``).

    Returns:
        One dict per run: ``world_size``, ``step_s``, ``samples_per_s``
        (global batch / step time), ``speedup`` (strong: ``t(1)/t(N)``;
        weak: ``thr(N)/thr(1)``, Gustafson's scaled speed-up) and
        ``efficiency`` (speed-up / N).

    Raises:
        ValueError: unknown kind, no N = 1 run, lengths differ, or a time <= 0.
    """
    if kind not in ("strong", "weak"):
        raise ValueError(f"kind must be 'strong' or 'weak', not {kind!r}")
    n = np.asarray(world_sizes, dtype=float)
    t = np.asarray(step_seconds, dtype=float)
    _check_n(n)
    if n.shape != t.shape or np.any(t <= 0):
        raise ValueError("need one positive step time per world size")
    if 1 not in n:
        raise ValueError("need a run with one rank as the reference")
    global_batch = batch * n if kind == "weak" else np.full_like(n, batch)
    thr = global_batch / t
    thr1 = thr[list(n).index(1)]
    rows = []
    for ni, ti, th in zip(n, t, thr, strict=True):
        speedup = th / thr1
        rows.append(
            {
                "world_size": int(ni),
                "step_s": float(ti),
                "samples_per_s": float(th),
                "speedup": float(speedup),
                "efficiency": float(speedup / ni),
            }
        )
    return rows


def exposed_comm(
    bucket_bytes: Sequence[float],
    ready_s: Sequence[float],
    backward_s: float,
    all_reduce: AlphaBeta,
) -> float:
    """Seconds of all-reduce left after backward ends, buckets reduced one after another.

    Bucket i can start when its gradients are ready (``ready_s[i]``,
    seconds after backward began) and when bucket i-1 is done (one
    communication stream, as DDP's reducer launches them in order); it
    takes ``all_reduce.predict(bucket_bytes[i])``, or 0 where a fit with a negative
    alpha (noisy small messages) predicts less. The exposed time is
    ``max(0, end of the last bucket - backward_s)``.

    Args:
        bucket_bytes: size of each bucket, in launch order, bytes.
        ready_s: when each bucket's last gradient is ready, seconds.
        backward_s: duration of backward, seconds.
        all_reduce: alpha-beta fit of the all-reduce time at this world size.

    Raises:
        ValueError: lengths differ.
    """
    if len(bucket_bytes) != len(ready_s):
        raise ValueError(f"{len(bucket_bytes)} buckets but {len(ready_s)} ready times")
    end = 0.0
    for size, ready in zip(bucket_bytes, ready_s, strict=True):
        end = max(end, ready) + max(0.0, float(all_reduce.predict(size)))
    return max(0.0, end - backward_s)


def comm_can_overlap(device_type: str, world_size: int, threads_per_rank: int, cpus: int) -> bool:
    """Whether gradient all-reduces can run while backward computes, without slowing it.

    On a GPU, NCCL runs on a CUDA stream of its own and the copy engines and
    links move the bytes, so communication can hide behind backward (Li et
    al., VLDB 2020, section 3.2.3). On a CPU, gloo's copies and sums are CPU
    work: they hide only if a core is left over once every rank's compute
    threads have one (``world_size * threads_per_rank < cpus``); otherwise
    they take cores backward needs, and every bucket's time adds to the step.

    Args:
        device_type: ``"cuda"`` or ``"cpu"`` (``torch.device.type``).
        world_size: ranks on this machine.
        threads_per_rank: compute threads per rank (``torch.get_num_threads()``).
        cpus: CPU cores of the machine (``os.cpu_count()``).

    Raises:
        ValueError: a count below 1.
    """
    _check_counts(world_size, threads_per_rank, cpus)
    if device_type == "cuda":
        return True
    return world_size * threads_per_rank < cpus


def _check_counts(world_size: int, threads_per_rank: int, cpus: int) -> None:
    if min(world_size, threads_per_rank, cpus) < 1:
        raise ValueError(
            f"need world_size, threads_per_rank and cpus >= 1, got "
            f"{world_size}, {threads_per_rank}, {cpus}"
        )


def compute_slowdown(device_type: str, world_size: int, threads_per_rank: int, cpus: int) -> float:
    """How much longer a rank's compute takes in an N-rank job than alone on the machine.

    On a GPU every rank has a device of its own: 1. On a CPU the ranks'
    compute threads share the cores: once there are more threads than cores
    (``world_size * threads_per_rank > cpus``), each runs that many times
    slower, so the factor is ``max(1, world_size * threads_per_rank / cpus)``.
    It ignores what the ranks share below that (memory bandwidth, caches):
    a prediction from one rank's compute is off by what they cost.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        world_size: ranks on this machine.
        threads_per_rank: compute threads per rank.
        cpus: CPU cores of the machine.

    Returns:
        The factor, >= 1.

    Raises:
        ValueError: a count below 1.
    """
    _check_counts(world_size, threads_per_rank, cpus)
    if device_type == "cuda":
        return 1.0
    return max(1.0, world_size * threads_per_rank / cpus)


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """``t_step = t_forward + t_backward + exposed communication + t_optimizer``, seconds.

    The compute terms are measured through the same DDP wrapper in a
    process group of one rank, so they include the wrapper's own work (its
    hooks, the copies of the gradients into flat buckets and back, the
    final callback), everything but the communication. Measured on one rank
    alone, they predict N ranks once :meth:`slowed` by the ranks' share of
    the cores (:func:`compute_slowdown`). The communication comes from the
    alpha-beta fit of all_reduce at the world size and from the bucket sizes.

    With ``overlap`` (see :func:`comm_can_overlap`), bucket i is taken to be
    ready when backward has produced the gradients of buckets 0..i, in
    proportion to their bytes (backward runs roughly from the last layer to
    the first, the order DDP fills buckets in), and only the all-reduce time
    that outlasts backward is exposed. Without it, every bucket's all-reduce
    is exposed: the buckets' times add up after backward.

    Attributes:
        forward_s, backward_s, optimizer_s: compute times of one step,
            seconds, wrapper included.
        overlap: whether communication can run while backward computes.
    """

    forward_s: float
    backward_s: float
    optimizer_s: float
    overlap: bool = True

    def slowed(self, factor: float) -> StepTimeModel:
        """The same model with every compute term ``factor`` times longer.

        Use it to carry compute measured on one rank to N ranks that share
        the cores (:func:`compute_slowdown`).

        Raises:
            ValueError: ``factor <= 0``.
        """
        if factor <= 0:
            raise ValueError(f"the slow-down factor must be > 0, not {factor}")
        return dataclasses.replace(
            self,
            forward_s=self.forward_s * factor,
            backward_s=self.backward_s * factor,
            optimizer_s=self.optimizer_s * factor,
        )

    def ready_times(self, bucket_bytes: Sequence[float]) -> list[float]:
        """When each bucket is full, seconds into backward (proportional to bytes)."""
        total = float(sum(bucket_bytes))
        if total <= 0:
            raise ValueError("buckets hold no bytes")
        if not self.overlap:  # nothing starts before backward has ended
            return [self.backward_s] * len(bucket_bytes)
        return list(self.backward_s * np.cumsum(bucket_bytes) / total)

    def exposed(
        self, bucket_bytes: Sequence[float], all_reduce: AlphaBeta, world_size: int
    ) -> float:
        """Exposed communication in seconds (0 for one rank, which communicates nothing)."""
        if world_size == 1:
            return 0.0
        return exposed_comm(
            bucket_bytes, self.ready_times(bucket_bytes), self.backward_s, all_reduce
        )

    def predict(
        self, bucket_bytes: Sequence[float], all_reduce: AlphaBeta, world_size: int
    ) -> float:
        """Predicted step time in seconds.

        Raises:
            ValueError: the buckets hold no bytes.
        """
        compute = self.forward_s + self.backward_s + self.optimizer_s
        return compute + self.exposed(bucket_bytes, all_reduce, world_size)
