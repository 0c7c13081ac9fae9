"""Measuring communication: timing, algbw/busbw, the alpha-beta model, scaling.

Definitions follow nccl-tests' PERFORMANCE.md
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

- algorithm bandwidth ``algbw = S / t``: the message size S in bytes over
  the time t of one operation;
- bus bandwidth ``busbw = algbw * factor``, the factor making the number
  comparable to the link's peak whatever the world size n: ``2(n-1)/n``
  for all_reduce, ``(n-1)/n`` for reduce_scatter, all_gather and
  all_to_all, ``1`` for broadcast, reduce and send/recv;
- 1 GB/s = 1e9 bytes per second.

Timing differs from nccl-tests on one point, for a noisy shared CPU: each
timed iteration starts at a barrier, its time is the slowest rank's
(``all_reduce(MAX)`` over ranks) and the reported time is the median over
iterations after warm-up, with the interquartile range as the spread
(nccl-tests reports the mean over iterations).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .runtime import DistContext, barrier

__all__ = [
    "BUSBW_FACTORS",
    "COLLECTIVES",
    "AlphaBeta",
    "Timing",
    "algbw",
    "busbw",
    "busbw_factor",
    "busbw_plateau",
    "fit_alpha_beta",
    "fit_each",
    "format_bytes",
    "message_sizes",
    "parameter_server_time",
    "predicted_busbw",
    "read_records",
    "ring_all_reduce_time",
    "run_metadata",
    "runnable_tasks",
    "scaling_efficiency",
    "slowest_rank",
    "summarize",
    "time_op",
    "write_records",
]

GB = 1e9
"""Bytes in a GB, as nccl-tests counts them."""

BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
"""busbw / algbw for each collective at world size n (nccl-tests PERFORMANCE.md)."""


def busbw_factor(collective: str, world_size: int) -> float:
    """The factor busbw / algbw of ``collective`` with ``world_size`` ranks.

    From nccl-tests PERFORMANCE.md: an all_reduce of S bytes makes every
    rank send and receive 2(n-1)/n * S bytes, so ``busbw = algbw * 2(n-1)/n``
    is the bandwidth each link actually carried.

    Raises:
        ValueError: unknown collective (see :data:`BUSBW_FACTORS`) or
            ``world_size < 1``.
    """
    if collective not in BUSBW_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; one of {sorted(BUSBW_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    return BUSBW_FACTORS[collective](world_size)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth ``S / t`` in bytes per second (nccl-tests PERFORMANCE.md).

    Raises:
        ValueError: if ``seconds <= 0`` or ``nbytes < 0``.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, not {seconds}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, not {nbytes}")
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, collective: str, world_size: int) -> float:
    """Bus bandwidth in bytes per second: ``algbw * busbw_factor`` (nccl-tests).

    Raises:
        ValueError: as :func:`algbw` and :func:`busbw_factor`.
    """
    return algbw(nbytes, seconds) * busbw_factor(collective, world_size)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Summary of repeated timings, in seconds.

    Attributes:
        median: the median time.
        q1, q3: first and third quartiles (the interquartile range is the spread).
        min: the fastest repeat.
        repeats: how many timings.
    """

    median: float
    q1: float
    q3: float
    min: float
    repeats: int

    @property
    def iqr(self) -> float:
        """Interquartile range ``q3 - q1`` in seconds."""
        return self.q3 - self.q1


def summarize(times: Sequence[float]) -> Timing:
    """Median, quartiles and minimum of ``times`` (seconds).

    Raises:
        ValueError: if ``times`` is empty.
    """
    if len(times) == 0:
        raise ValueError("no timings to summarize")
    values = sorted(float(t) for t in times)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Timing(statistics.median(values), q1, q3, values[0], len(values))


def _sync(ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def time_op(
    fn: Callable[[], object], ctx: DistContext, warmup: int = 2, repeats: int = 10
) -> list[float]:
    """Time ``fn()`` ``repeats`` times after ``warmup`` calls; slowest rank per repeat.

    Each repeat starts at a barrier, so all ranks start together, and ends
    when this rank's ``fn`` returned (and, on CUDA, the device finished).
    The per-rank times are then combined with one ``all_reduce(MAX)``, so a
    repeat counts as long as its slowest rank took: a collective is only
    done when every rank is. All ranks must call this together.

    Args:
        fn: the operation; a collective every rank calls.
        ctx: this process's context (``runtime.distributed()``).
        warmup: untimed calls first (connections, allocations, caches), >= 0.
        repeats: timed calls, >= 1.

    Returns:
        ``repeats`` times in seconds, the same list on every rank.

    Raises:
        ValueError: if ``warmup < 0`` or ``repeats < 1``.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, not {warmup} and {repeats}")
    for _ in range(warmup):
        fn()
    _sync(ctx)
    times = []
    for _ in range(repeats):
        barrier(ctx)
        start = time.perf_counter()
        fn()
        _sync(ctx)
        times.append(time.perf_counter() - start)
    t = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    if ctx.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """The alpha-beta (latency-bandwidth) model ``t(S) = alpha + beta * S``.

    Attributes:
        alpha: latency in seconds, the time of an empty message.
        beta: seconds per byte, ``1 / bandwidth``.
    """

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """``1 / beta`` in bytes per second (``inf`` when beta is 0)."""
        return float("inf") if self.beta == 0 else 1.0 / self.beta

    @property
    def half_bandwidth_bytes(self) -> float:
        """The size ``alpha / beta`` at which half the bandwidth is reached, in bytes."""
        return float("inf") if self.beta == 0 else self.alpha / self.beta

    def predict(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """``alpha + beta * nbytes`` in seconds."""
        return self.alpha + self.beta * np.asarray(nbytes, dtype=float)


def fit_alpha_beta(
    nbytes: Sequence[float], seconds: Sequence[float], relative: bool = True
) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + beta * S`` to measured times.

    With ``relative=True`` (default) each point is weighted by ``1/t``, so
    the fit minimises relative errors: sizes spanning four decades then
    all count, instead of the largest ones alone deciding alpha.

    Args:
        nbytes: message sizes S in bytes, at least two distinct.
        seconds: measured times t in seconds (> 0), same length.
        relative: weight by ``1/t`` (else ordinary least squares).

    Returns:
        :class:`AlphaBeta`; alpha may come out negative when latency is
        below the noise.

    Raises:
        ValueError: different lengths, fewer than two distinct sizes, or a
            non-positive time.
    """
    s = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"need two 1-D sequences of one length, got {s.shape} and {t.shape}")
    if len(np.unique(s)) < 2:
        raise ValueError("need at least two distinct message sizes to fit alpha and beta")
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    w = 1.0 / t if relative else np.ones_like(t)
    a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    return AlphaBeta(float(alpha), float(beta))


def ring_all_reduce_time(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    """Predicted ring all-reduce time: ``2(N-1) * alpha + 2(N-1)/N * S * beta`` seconds.

    2(N-1) steps (reduce-scatter then all-gather), each moving one chunk of
    S/N bytes over every link at once (Patarasuk and Yuan 2009; Gibiansky
    2017). The model assumes every rank has a full-duplex link of its own;
    where all ranks share one machine's cores, time follows the total
    bytes instead.

    Args:
        nbytes: message size S in bytes.
        world_size: N ranks, >= 1.
        link: the point-to-point model of one step's exchange (seconds, s/byte).

    Returns:
        Seconds; 0 for one rank.

    Raises:
        ValueError: if ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    steps = 2 * (world_size - 1)
    return steps * link.alpha + steps / world_size * nbytes * link.beta


def parameter_server_time(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    """Predicted parameter-server time: ``2 * alpha + 2(N-1) * S * beta`` seconds.

    The server's link carries the N-1 workers' tensors in, then the result
    out to each, 2(N-1)S bytes one after the other: the bottleneck that
    grows with N (the byte counts are ``comm_cost.parameter_server_bytes``).

    Args:
        nbytes: message size S in bytes.
        world_size: N ranks, >= 1.
        link: the point-to-point model of a one-way send (seconds, s/byte).

    Returns:
        Seconds; 0 for one rank.

    Raises:
        ValueError: if ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if world_size == 1:
        return 0.0
    return 2 * link.alpha + 2 * (world_size - 1) * nbytes * link.beta


def scaling_efficiency(
    value_1: float, value_n: float, world_size: int, kind: str = "weak"
) -> float:
    """Parallel efficiency, 1.0 meaning perfect scaling.

    - ``kind="weak"``: values are throughputs (e.g. samples/s) with a fixed
      amount of work per rank: ``thr(N) / (N * thr(1))``.
    - ``kind="strong"``: values are times for a fixed total amount of work:
      ``t(1) / (N * t(N))``, the speed-up ``t(1)/t(N)`` divided by N.

    Raises:
        ValueError: unknown kind, non-positive values or ``world_size < 1``.
    """
    if kind not in ("weak", "strong"):
        raise ValueError(f"kind must be 'weak' or 'strong', not {kind!r}")
    if value_1 <= 0 or value_n <= 0:
        raise ValueError("values must be positive")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if kind == "weak":
        return value_n / (world_size * value_1)
    return value_1 / (world_size * value_n)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Sizes ``min_bytes * factor**k`` up to ``max_bytes``, in bytes (like ``-b -e -f``).

    Raises:
        ValueError: if ``min_bytes < 1``, ``max_bytes < min_bytes`` or ``factor < 2``.
    """
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad sweep {min_bytes}..{max_bytes} by {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def format_bytes(nbytes: float) -> str:
    """``4096 -> '4 KiB'``, ``16 * 2**20 -> '16 MiB'`` (binary prefixes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
"""The collectives the lesson sweeps, in nccl-tests' order of size conventions."""


def slowest_rank(times_by_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per iteration, the time of the slowest rank, in seconds.

    A collective is finished only when every rank has finished it, so an
    iteration lasts as long as its slowest rank (what :func:`time_op` gets
    with one ``all_reduce(MAX)``). Taking the median of one rank's own
    times instead would hide a straggler.

    Args:
        times_by_rank: ``[world_size][iterations]`` seconds, e.g. gathered
            from every rank.

    Returns:
        ``iterations`` seconds, the maximum over ranks of each iteration.

    Raises:
        ValueError: no ranks, or ranks with different numbers of iterations.
    """
    if len(times_by_rank) == 0:
        raise ValueError("no ranks' timings given")
    lengths = {len(t) for t in times_by_rank}
    if len(lengths) != 1:
        raise ValueError(f"every rank must time the same iterations, got lengths {sorted(lengths)}")
    return [max(column) for column in zip(*times_by_rank, strict=True)]


def predicted_busbw(
    fit: AlphaBeta, nbytes: float | np.ndarray, collective: str, world_size: int
) -> float | np.ndarray:
    """busbw in bytes/s that the alpha-beta fit predicts at size ``nbytes``.

    ``S / (alpha + beta S) * factor`` (nccl-tests' busbw of the modelled
    time): it grows with S and tends to :func:`busbw_plateau`; it is half
    the plateau at ``S = alpha / beta``.

    Raises:
        ValueError: as :func:`busbw_factor`.
    """
    s = np.asarray(nbytes, dtype=float)
    return s / fit.predict(s) * busbw_factor(collective, world_size)


def busbw_plateau(fit: AlphaBeta, collective: str, world_size: int) -> float:
    """The busbw in bytes/s that large messages approach: ``factor / beta``.

    For S much larger than ``alpha / beta`` the time is ``beta S`` and
    algbw tends to ``1 / beta``; busbw scales it by the collective's factor
    (nccl-tests PERFORMANCE.md).

    Raises:
        ValueError: as :func:`busbw_factor`.
    """
    return fit.bandwidth * busbw_factor(collective, world_size)


def fit_each(
    rows: Iterable[Mapping[str, object]],
    key: str = "collective",
    size: str = "bytes",
    seconds: str = "median_s",
    min_bytes: float = 0,
) -> dict[str, AlphaBeta]:
    """One alpha-beta fit (:func:`fit_alpha_beta`, relative errors) per value of ``key``.

    Args:
        rows: records such as :func:`write_records` stores, each with the
            fields named by ``key``, ``size`` (bytes) and ``seconds``.
        key: the field that names the curve (e.g. the collective).
        size: the field with the message size S in bytes.
        seconds: the field with the time in seconds.
        min_bytes: ignore smaller messages (e.g. below a transport switch).

    Returns:
        ``{curve: AlphaBeta}`` in order of first appearance.

    Raises:
        ValueError: a curve has fewer than two distinct sizes, or a row
            lacks a field.
    """
    points: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        for field in (key, size, seconds):
            if field not in row:
                raise ValueError(f"a row has no field {field!r}: {dict(row)}")
        if float(row[size]) < min_bytes:
            continue
        xs, ts = points.setdefault(str(row[key]), ([], []))
        xs.append(float(row[size]))
        ts.append(float(row[seconds]))
    return {name: fit_alpha_beta(xs, ts) for name, (xs, ts) in points.items()}


def runnable_tasks(seconds: float = 1.0, samples: int = 20) -> float | None:
    """How many other tasks were ready to run, on average over the next ``seconds``.

    How busy the machine is right now, before a measurement: on Linux the
    fourth field of ``/proc/loadavg`` ("running/total") counts the tasks
    (threads) running or ready to run at that instant, the reading process
    included; this is the mean of ``samples`` readings, less that one.
    Elsewhere the one-minute load average, which lags by about a minute.

    Args:
        seconds: how long to sample, >= 0.
        samples: readings, >= 1.

    Returns:
        Tasks (a mean, >= 0), or None where the system reports neither.

    Raises:
        ValueError: ``seconds < 0`` or ``samples < 1``.
    """
    if seconds < 0 or samples < 1:
        raise ValueError(f"need seconds >= 0 and samples >= 1, not {seconds} and {samples}")
    proc = pathlib.Path("/proc/loadavg")
    if not proc.exists():
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    counts = []
    for i in range(samples):
        if i:
            time.sleep(seconds / samples)
        counts.append(int(proc.read_text().split()[3].split("/")[0]) - 1)
    return max(0.0, sum(counts) / len(counts))


def run_metadata(command: Sequence[str] | None = None) -> dict[str, object]:
    """What a result needs to be compared and re-measured: machine, versions, load, command.

    Args:
        command: the command line; default ``sys.argv`` with ``python`` in
            front, or ``torchrun --nproc_per_node=N`` under torchrun; paths
            shown relative to the current folder when inside it.

    Returns:
        JSON-ready dict: ``machine`` (architecture, processor count, OS),
        ``python``, ``torch``, ``numpy``, ``cuda`` (None on CPU), ``gpu``
        (name or None), ``load_average_1min`` (None where the OS has none),
        ``threads_per_rank`` (``torch.get_num_threads()``),
        ``omp_num_threads`` (the variable, or None), ``command`` and
        ``utc`` (ISO 8601 seconds).
    """
    if command is None:
        # Under torchrun, sys.argv is the script's; the launcher's line is what a reader retypes.
        nproc = os.environ.get("LOCAL_WORLD_SIZE")
        launcher = ["torchrun", f"--nproc_per_node={nproc}"] if nproc else ["python"]
        command = [*launcher, *sys.argv]
    cwd = pathlib.Path.cwd()
    shown = []
    for part in command:
        path = pathlib.Path(part)
        if path.is_absolute() and path.is_relative_to(cwd):
            part = str(path.relative_to(cwd))
        shown.append(part)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "os": platform.system()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": gpu,
        "load_average_1min": load,
        "threads_per_rank": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "command": shlex.join(shown),
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_records(
    path: str | os.PathLike,
    rows: Sequence[Mapping[str, object]],
    meta: Mapping[str, object],
    **extra: object,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``rows`` as ``<path>.json`` (with ``meta`` and ``extra``) and ``<path>.csv``.

    The JSON file is ``{"meta": meta, "rows": rows, **extra}``; the CSV has
    one line per row, the union of the rows' keys as columns (in order of
    first appearance), and the metadata's ``command`` and
    ``load_average_1min`` in every line, so a spreadsheet keeps them too.

    Args:
        path: file name with or without suffix; ``.json`` and ``.csv``
            are written next to each other (folders are created).
        rows: flat records (numbers and strings).
        meta: from :func:`run_metadata`.
        **extra: more JSON values (fits, ratios) for the JSON file.

    Returns:
        The two paths written.

    Raises:
        ValueError: ``rows`` is empty or a row holds a list or dict.
    """
    if not rows:
        raise ValueError("no rows to write")
    base = pathlib.Path(path)
    if base.suffix in (".json", ".csv"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (list, dict)):
                raise ValueError(f"row field {k!r} is not flat: {v!r}")
            if k not in columns:
                columns.append(k)
    json_path, csv_path = base.with_name(base.name + ".json"), base.with_name(base.name + ".csv")
    record = {"meta": dict(meta), "rows": [dict(r) for r in rows], **extra}
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, "command", "load_average_1min"])
        writer.writeheader()
        for row in rows:
            load = meta.get("load_average_1min")
            writer.writerow({**row, "command": meta.get("command"), "load_average_1min": load})
    return json_path, csv_path


def read_records(path: str | os.PathLike) -> dict[str, object]:
    """Read what :func:`write_records` wrote (the ``.json`` file).

    Raises:
        FileNotFoundError: no such file; run the benchmark command that
            makes it (benchmarks/README.md lists them).
    """
    p = pathlib.Path(path)
    if p.suffix != ".json":
        p = p.with_name(p.name + ".json")
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: run the command benchmarks/README.md gives for it")
    return json.loads(p.read_text())
