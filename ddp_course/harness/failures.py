"""Reading a failed or hung job: the errors the launchers raise, which rank failed
first, the end of its traceback, whether a log shows a timeout, and where each rank
was when a hung job was stopped."""

from __future__ import annotations

import linecache
import pathlib
import re

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "failing_rank",
    "is_timeout",
    "read_rank_logs",
    "strip_rank_prefix",
    "tail_traceback",
    "torchrun_summary",
    "where_stuck",
]


class LaunchError(RuntimeError):
    """A launched job failed.

    Attributes:
        rank: the global rank that failed first (``None`` if unknown).
        returncode: torchrun's exit code.
        logs: per-rank output ``{rank: text}``.
        output: the job's own output as it streamed (for torchrun: rank 0's lines and
            the agent's, its failure summary included; ``""`` when not kept).
    """

    def __init__(
        self,
        message: str,
        rank: int | None,
        returncode: int,
        logs: dict[int, str],
        output: str = "",
    ):
        super().__init__(message)
        self.rank, self.returncode, self.logs = rank, returncode, logs
        self.output = output


class LaunchTimeout(LaunchError):
    """The job ran past its timeout; every process of it was killed."""


RANK_TAG = re.compile(r"^\[[^\]]*?(\d+)\]:", re.MULTILINE)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.MULTILINE)
_FAILED_AT = re.compile(r"\[ddp_course\] rank (\d+) failed at t=([\d.]+)")
_ROOT_RANK = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)", re.DOTALL)
# One failure in torchrun's summary: "time : 2026-01-31_12:00:05", "host : ...", "rank : 1 (...".
_SUMMARY_ENTRY = re.compile(
    r"^\s*time\s*:\s*(\S+)\s*\n\s*host\s*:.*\n\s*rank\s*:\s*(\d+)", re.MULTILINE
)


def strip_rank_prefix(line: str) -> str:
    """``line`` without torchrun's ``[default0]:`` tag (from ``--tee``)."""
    return RANK_TAG.sub("", line, count=1)


# What a collective that waited too long leaves in a rank's log, on either
# backend. gloo raises in the rank's thread: "... Timed out waiting 5000ms for
# recv operation to complete". nccl's host call returns at once; its watchdog
# thread later logs "Watchdog caught collective operation timeout:
# WorkNCCL(...) ran for 5001 milliseconds before timing out" and takes the
# process down. A store wait that runs out says "Timed out after ...".
_TIMEOUT = re.compile(r"timed out|before timing out|collective operation timeout", re.IGNORECASE)


def is_timeout(text: str) -> bool:
    """Whether ``text`` (a rank's log) shows a collective or store timeout on
    gloo or nccl (see the comment above for the words each backend uses)."""
    return _TIMEOUT.search(text) is not None


def read_rank_logs(log_dir: pathlib.Path) -> dict[int, str]:
    """Every rank's output ``{rank: stdout + stderr}`` from torchrun's ``--log-dir``.

    torchrun writes <log_dir>/<run_id>/attempt_<k>/<local_rank>/{stdout,stderr}.log; one
    node here, so the local rank is the global rank; the attempts are concatenated."""
    logs: dict[int, str] = {}
    for rank_dir in sorted(log_dir.glob("*/attempt_*/*")):
        if not rank_dir.name.isdigit():
            continue
        text = ""
        for name in ("stdout.log", "stderr.log"):
            path = rank_dir / name
            if path.exists():
                text += path.read_text(errors="replace")
        rank = int(rank_dir.name)
        logs[rank] = logs.get(rank, "") + text
    return logs


def failing_rank(torchrun_output: str, logs: dict[int, str]) -> int | None:
    """The rank that failed first, or None when nothing says.

    Ranks inside ddp_course.runtime.distributed() stamp the time they failed; the
    earliest is the cause, the others died of its absence. Without stamps: the rank of
    torchrun's "Root Cause" report, else the first rank whose log holds a traceback."""
    stamps = [
        (float(t), int(rank)) for text in logs.values() for rank, t in _FAILED_AT.findall(text)
    ]
    if stamps:
        return min(stamps)[1]
    match = _ROOT_RANK.search(torchrun_output)
    if match:
        return int(match.group(1))
    for rank, text in sorted(logs.items()):
        if "Traceback (most recent call last)" in text:
            return rank
    return None


def torchrun_summary(torchrun_output: str) -> tuple[int | None, dict[int, str]]:
    """What torchrun's own failure summary says: the rank its "Root Cause (first observed
    failure)" names, and the time it gives each failed rank (whole seconds, as printed).

    ``(None, {})`` when ``torchrun_output`` (the agent's output, e.g. echoed by
    :func:`ddp_course.harness.launch.torchrun`) holds no summary."""
    match = _ROOT_RANK.search(torchrun_output)
    times = {int(rank): time for time, rank in _SUMMARY_ENTRY.findall(torchrun_output)}
    return (int(match.group(1)) if match else None), times


def tail_traceback(text: str, lines: int = 25) -> str:
    """The last ``lines`` lines of the last traceback in ``text`` (all of ``text``'s end
    when it holds none), without torchrun's rank prefixes."""
    text = _RANK_PREFIX.sub("", text)
    start = text.rfind("Traceback (most recent call last)")
    body = text[start:] if start >= 0 else text
    return "\n".join(body.rstrip().splitlines()[-lines:])


_FRAME = re.compile(
    r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE
)
_FAULTHANDLER_DUMP = "Fatal Python error: Aborted"


def where_stuck(logs: dict[int, str], script: pathlib.Path) -> str:
    """One line per rank: the script line and the innermost Python function it was
    in when faulthandler dumped its stack, or '' when no rank dumped one."""
    lines = []
    for rank, text in sorted(logs.items()):
        start = text.rfind(_FAULTHANDLER_DUMP)
        if start < 0:
            continue
        frames = list(_FRAME.finditer(_RANK_PREFIX.sub("", text[start:])))
        if not frames:
            continue
        innermost = frames[0]  # faulthandler lists the most recent call first
        mine = next((f for f in frames if pathlib.Path(f["file"]).name == script.name), None)
        where = (
            f"in {innermost['func']} ({pathlib.Path(innermost['file']).name}:{innermost['line']})"
        )
        if mine is not None and mine is not innermost:
            code = linecache.getline(mine["file"], int(mine["line"])).strip()
            where += f", called from {script.name}:{mine['line']}: {code}"
        lines.append(f"  rank {rank}: {where}")
    if not lines:
        return ""
    return (
        "\nWhere each rank was when it was stopped (its Python stack, by faulthandler):\n"
        + "\n".join(lines)
    )
