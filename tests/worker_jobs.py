"""Launching a test worker (``tests/workers/``) under torchrun and reading what its ranks
report: shared by the multiprocess tests, each of which launches one job per world size
and reads every rank's records in several tests."""

import pathlib

from ddp_course.harness import launch

WORKERS = pathlib.Path(__file__).resolve().parent / "workers"


def run_worker(name: str, args: list[str], nproc: int, timeout_s: float = 240.0) -> dict:
    """The results of ``tests/workers/<name>`` run with ``args`` on ``nproc`` ranks.

    Raises:
        AssertionError: the results name another world size than ``nproc``.
        ddp_course.harness.launch.LaunchError: a rank failed (its traceback is in it).
    """
    job = launch.torchrun(
        WORKERS / name, args, nproc=nproc, results=True, echo=False, timeout_s=timeout_s
    )
    assert job.results["world_size"] == nproc
    return job.results


def failed(report: dict) -> dict[str, str]:
    """``{check: why}`` of the checks of one rank's report that failed (a worker records
    ``None`` for a check that passed: see ``tests/workers/worker_checks.py``)."""
    return {name: why for name, why in report["fails"].items() if why is not None}
