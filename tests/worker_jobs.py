"""Launching a test worker (``tests/workers/``) under torchrun and reading what its ranks
report: shared by the multiprocess tests, each of which launches one job per world size
and reads every rank's records in several tests (:func:`worker_fixture`)."""

import pathlib
from collections.abc import Sequence

import pytest

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
    world = job.results["world_size"]
    assert world == nproc, f"{name} reported world size {world}, launched {nproc}"
    return job.results


def worker_fixture(name: str, args: Sequence[str], world_sizes: Sequence[int] = (2,)):
    """The test module's ``job`` fixture: ``tests/workers/<name>`` launched once per world
    size in ``world_sizes`` (module scope, ids ``2ranks``, ``4ranks``...), its results
    (:func:`run_worker`) shared by every test of the module that takes ``job``.

    Use as ``job = worker_jobs.worker_fixture("x_check.py", ARGS, world_sizes=[2, 4])``.
    """

    @pytest.fixture(scope="module", params=list(world_sizes), ids=lambda n: f"{n}ranks")
    def job(request):
        return run_worker(name, list(args), request.param)

    return job


def failed(report: dict) -> dict[str, str]:
    """``{check: why}`` of the checks of one rank's report that failed (a worker records
    ``None`` for a check that passed: see ``tests/workers/worker_checks.py``)."""
    return {name: why for name, why in report["fails"].items() if why is not None}
