"""What every file under ``tests/gpu/`` shares: the GPU count, skip marks that say why,
the results keeper that ``python -m ddp_course gpu-check`` reads, and runners (torchrun,
and one plain process) that follow the launcher's device plan.

Importable from any test (``pyproject.toml`` puts ``tests/`` on ``sys.path``); it holds
no test itself, so pytest collects nothing from it.
"""

import json
import os
import pathlib

import pytest

from ddp_course import runtime
from ddp_course.harness import launch
from ddp_course.harness.gpu_check import RESULTS_ENV
from ddp_course.harness.gpu_plan import WORLD_SIZE_1

GPUS = runtime.gpu_count()
MAX_RANKS = 4  # more GPUs than this: the nccl jobs still use 4 ranks, to stay short
RANKS = min(GPUS, MAX_RANKS)
needs_gpu = pytest.mark.skipif(
    GPUS == 0, reason="needs a CUDA GPU; none is visible (torch.cuda.device_count() == 0)"
)
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more CUDA GPUs; {GPUS} visible")
needs_4_gpus = pytest.mark.skipif(GPUS < 4, reason=f"needs 4 or more CUDA GPUs; {GPUS} visible")


def world_size_1(what: str) -> pytest.MarkDecorator:
    """Skip with exactly one GPU (every nccl job there has one rank), saying which
    multi-rank nccl path that leaves unexercised (no GPU at all: ``needs_gpu`` says so)."""
    return pytest.mark.skipif(
        GPUS == 1, reason=f"{WORLD_SIZE_1} (one GPU): {what}; needs 2 or more GPUs"
    )


def keep(name: str, results: dict) -> None:
    """Write ``results`` to ``$DDP_COURSE_GPU_RESULTS/<name>.json`` when gpu-check asks."""
    folder = os.environ.get(RESULTS_ENV)
    if folder:
        path = pathlib.Path(folder, f"{name}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")


def run_plain(root: pathlib.Path, script: str, args=()) -> dict:
    """``python scripts/<script>`` as one plain process on this machine's first GPU (the
    launcher's device plan); its JSON results.

    Raises:
        ddp_course.harness.launch.LaunchError: the script failed (its traceback in the message).
    """
    job = launch.python(
        root / "scripts" / script, list(args), results=True, echo=False, timeout_s=300
    )
    return job.results


def run(root: pathlib.Path, script: str, args=(), nproc: int = RANKS, **kwargs) -> dict:
    """``scripts/<script>`` under torchrun with the launcher's device plan; its JSON results.

    Raises:
        ddp_course.harness.launch.LaunchError: a rank failed (its traceback in the message).
    """
    job = launch.torchrun(
        root / "scripts" / script,
        list(args),
        nproc=nproc,
        results=True,
        echo=False,
        timeout_s=300,
        **kwargs,
    )
    return job.results
