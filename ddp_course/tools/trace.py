"""Reading a ``torch.profiler`` Chrome trace: when did communication overlap backward?

``prof.export_chrome_trace(path)`` writes the Chrome Trace Event format
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
a JSON object whose ``traceEvents`` list holds complete events
``{"ph": "X", "name", "cat", "ts", "dur", "pid", "tid"}`` with ``ts`` and
``dur`` in microseconds. ``record_function("backward")`` appears as a
``user_annotation`` event of that name on the training thread; gloo's
collectives as ``gloo:all_reduce`` events on its worker threads (nccl's as
``nccl:all_reduce``), which may run at the same time as one another. The
same file opens in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "BACKWARD_PATTERN",
    "COMM_PATTERN",
    "intervals",
    "load_trace",
    "overlap_report",
    "slim_trace",
    "total_length",
    "union",
    "intersection",
]

Interval = tuple[float, float]

COMM_PATTERN = r"^(gloo|nccl):all_reduce$"
"""Names of the all-reduce events gloo and nccl record (the work itself, not its launch)."""

BACKWARD_PATTERN = r"^autograd::engine::evaluate_function: "
"""The autograd engine's events, one per backward function run: when backward computed.

Not the ``record_function("backward")`` label around ``loss.backward()``. On
gloo that call returns only after DDP has waited for every bucket, so the label
contains all of the communication, exposed or not. On nccl it returns once the
all-reduces are queued on the GPU, and both the label and these events are
host-side spans: when the GPU computed and communicated is in the CUDA kernel
events (``ProfilerActivity.CUDA``), which this module does not read."""

KEEP_PATTERN = (
    r"^(gloo|nccl):|^autograd::engine::evaluate_function: |^(forward|backward|optimizer)$"
)
"""What :func:`slim_trace` keeps: communication, backward functions and the lessons' labels."""


def load_trace(path: str | os.PathLike) -> list[dict]:
    """The events of a Chrome trace file (a ``{"traceEvents": [...]}`` object or a bare list).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the JSON is neither form.
    """
    data = json.loads(pathlib.Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        return data["traceEvents"]
    if isinstance(data, list):
        return data
    raise ValueError(f"{path} is not a Chrome trace (no traceEvents list)")


def intervals(events: Iterable[Mapping], pattern: str, pid: int | None = None) -> list[Interval]:
    """``(start, end)`` in microseconds of the complete events whose name matches ``pattern``.

    Args:
        events: trace events (:func:`load_trace`).
        pattern: a regular expression, matched with ``re.search``.
        pid: only events of this process (a trace may merge several ranks).

    Returns:
        Sorted intervals, possibly overlapping (see :func:`union`).
    """
    rx = re.compile(pattern)
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or not rx.search(str(e.get("name", ""))):
            continue
        if pid is not None and e.get("pid") != pid:
            continue
        start = float(e["ts"])
        out.append((start, start + float(e["dur"])))
    return sorted(out)


def union(spans: Sequence[Interval]) -> list[Interval]:
    """Merge overlapping intervals: the time during which at least one was running."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if end < start:
            raise ValueError(f"interval ends before it starts: {(start, end)}")
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersection(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The time covered by both sets of intervals (each merged first)."""
    ua, ub = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(ua) and j < len(ub):
        start, end = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if start < end:
            out.append((start, end))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def total_length(spans: Sequence[Interval]) -> float:
    """Length of the union of ``spans`` (same unit as the intervals)."""
    return sum(end - start for start, end in union(spans))


def overlap_report(
    events: Iterable[Mapping],
    comm: str = COMM_PATTERN,
    compute: str = BACKWARD_PATTERN,
    pid: int | None = None,
) -> dict[str, float]:
    """How much of the communication ran while backward was running.

    Args:
        events: trace events (:func:`load_trace`).
        comm: regular expression for the communication events.
        compute: regular expression for the compute events (default:
            the autograd engine's backward functions, see
            :data:`BACKWARD_PATTERN`).
        pid: only this process's events.

    Returns:
        ``comm_us`` (time during which some communication ran),
        ``compute_us``, ``overlap_us`` (both at once) and
        ``overlap_fraction = overlap_us / comm_us``, the part of the
        all-reduce time hidden behind backward; times in microseconds.

    Raises:
        ValueError: the trace holds no event matching ``comm`` or ``compute``
            (record with ``record_function`` labels and a process group).
    """
    events = list(events)
    c, b = intervals(events, comm, pid), intervals(events, compute, pid)
    if not c:
        raise ValueError(f"no communication events matching {comm!r} in the trace")
    if not b:
        raise ValueError(
            f"no compute events matching {compute!r}: profile backward, or label it with "
            "record_function and pass that label"
        )
    comm_us, both = total_length(c), total_length(intersection(c, b))
    return {
        "comm_us": comm_us,
        "compute_us": total_length(b),
        "overlap_us": both,
        "overlap_fraction": both / comm_us,
    }


def slim_trace(events: Iterable[Mapping], keep: str = KEEP_PATTERN) -> dict:
    """A small trace with only the labelled, backward and communication events.

    Keeps ``ph == "M"`` metadata events (process and thread names) and the
    complete events whose name matches ``keep`` (:data:`KEEP_PATTERN`);
    drops the other operators, so a recorded trace stays small and still
    opens in Perfetto.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, ready for ``json.dump``.
    """
    rx = re.compile(keep)
    kept = []
    for e in events:
        if e.get("ph") == "M" or (e.get("ph") == "X" and rx.search(str(e.get("name", "")))):
            kept.append(
                {
                    k: e[k]
                    for k in ("ph", "name", "cat", "ts", "dur", "pid", "tid", "args")
                    if k in e
                }
            )
    return {"traceEvents": kept, "displayTimeUnit": "ms"}
