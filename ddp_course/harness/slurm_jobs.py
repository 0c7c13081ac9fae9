"""A Slurm job as ``scontrol`` reports it, and how it ended: the states in which a job is
over, ``scontrol -o`` records and their timestamps, and what
:meth:`ddp_course.harness.slurm.LocalSlurm.wait` returns (:class:`JobResult`) or raises
(:class:`SlurmJobError`).
"""

from __future__ import annotations

import dataclasses
import time

__all__ = ["FINAL_STATES", "JobResult", "SlurmJobError", "epoch_s", "parse_record"]

#: States in which a job is over
#: (https://slurm.schedmd.com/squeue.html#SECTION_JOB-STATE-CODES).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


class SlurmJobError(RuntimeError):
    """A job did not complete: it failed, was cancelled or ran past the wait.

    Attributes:
        job_id: Slurm's job id.
        state: the job's last state (``FAILED``, ``TIMEOUT``, ... or
            ``"WAIT_TIMEOUT"`` when :meth:`~ddp_course.harness.slurm.LocalSlurm.wait` gave
            up).
        output: the text of the job's output file (stdout and stderr).
    """

    def __init__(self, message: str, job_id: int, state: str, output: str):
        super().__init__(message)
        self.job_id, self.state, self.output = job_id, state, output


@dataclasses.dataclass(frozen=True)
class JobResult:
    """A job that completed with exit code 0.

    Attributes:
        job_id: Slurm's job id.
        state: ``"COMPLETED"``.
        output: the text of the job's output file (stdout and stderr).
        wall_s: seconds from :meth:`~ddp_course.harness.slurm.LocalSlurm.sbatch` to the
            end of the wait, queueing included.
        restarts: how many times Slurm requeued the job (``Restarts=``).
    """

    job_id: int
    state: str
    output: str
    wall_s: float
    restarts: int


def epoch_s(stamp: str) -> float | None:
    """Seconds since the epoch of an ``scontrol`` time (local time to the second, e.g.
    ``2026-11-27T01:03:58``); None for ``Unknown``, ``None`` or an empty field."""
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None  # "Unknown", "None" or empty


def parse_record(text: str) -> dict[str, str]:
    """One ``scontrol -o`` record (``Key=Value`` pairs separated by spaces) as
    ``{Key: Value}``; words without ``=`` are left out."""
    return dict(item.split("=", 1) for item in text.split() if "=" in item)
