"""A training run's timeline: one JSON line per event, written as it happens, so the
lines of a process killed with SIGKILL survive it; read back and measured per phase.

A line holds the writer's fields (``replica``, ``attempt``, ...), the event's own
(``event="step"``, ``step``, ``committed``, ``tokens``, ...) and ``t``, the wall-clock
time in seconds since the epoch (``time.time()``: comparable between the processes of
one machine).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Timeline", "read_timeline", "tokens_per_second"]


class Timeline:
    """Appends one JSON line per :meth:`add` to ``path`` and flushes it to the disk at
    once (``fsync``): a process killed a moment later keeps its lines.

    Args:
        path: the ``.jsonl`` file (appended to; None: write nothing).
        fields: written into every line (``replica=1, attempt=0``).
    """

    def __init__(self, path: str | os.PathLike | None, **fields: Any) -> None:
        self.path, self.fields = path, fields

    def add(self, **record: Any) -> None:
        """Write ``{**fields, **record, "t": time.time()}`` as one line."""
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({**self.fields, **record, "t": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_timeline(*paths: str | os.PathLike) -> list[dict[str, Any]]:
    """Every line of every file, in time order."""
    lines = []
    for path in paths:
        with open(path) as f:
            lines += [json.loads(line) for line in f if line.strip()]
    return sorted(lines, key=lambda x: x["t"])


def tokens_per_second(
    lines: Iterable[dict[str, Any]], windows: Sequence[tuple[float, float]]
) -> list[float]:
    """Tokens of committed steps per second in each window ``(start, end)`` (seconds,
    the timeline's clock): the ``tokens`` of every ``step`` line with ``committed``
    true whose time falls in ``[start, end)``, over ``end - start``. A step counts when
    it ends (its line is written then); steps that were not committed count nothing.

    Raises:
        ValueError: a window that does not end after it starts.
    """
    lines = [x for x in lines if x.get("event") == "step" and x.get("committed")]
    out = []
    for start, end in windows:
        if end <= start:
            raise ValueError(f"a window must end after it starts: ({start}, {end})")
        tokens = sum(x["tokens"] for x in lines if start <= x["t"] < end)
        out.append(tokens / (end - start))
    return out
