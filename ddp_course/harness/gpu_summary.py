"""The record ``python -m ddp_course gpu-check`` leaves and its verdict: the results folder
of a machine, the summary file, the table printed at the end and the exit status (parts
A, B and C are those of :mod:`ddp_course.harness.gpu_check`).

A check is one GPU test or one notebook (all its cells). The summary goes to
``benchmarks/gpu-<GPU name>[-x<N>]/gpu_check.json`` (see :func:`folder_name`)::

    {"command": "python -m ddp_course gpu-check --budget-s 540",
     "utc": "2026-11-23T09:00:00+00:00", "budget_s": 540, "wall_s": 512.4, "gpus": 1,
     "machine": {"python": "3.12.3", "torch": "2.13.0+cu130", "cuda": "13.0", ...,
                 "gpu_count": 1, "gpus": [{"name": "NVIDIA H100 80GB HBM3", ...}]},
     "plan": [{"part": "A", "check": "tests/gpu/test_gpu.py", "estimate_s": 205.0,
               "how": "13 of 14 tests run with 1 GPU(s), 15 s each", "fits": true}, ...],
     "passes": [{"part": "A", "what": "tests/gpu/test_gpu.py", "command": "python -m pytest
                 ...", "returncode": 0, "seconds": 101.2}, ...],
     "checks": [{"part": "A", "check": "tests/gpu/test_gpu.py::test_fsdp2_on_gpus",
                 "outcome": "passed", "seconds": 14.2, "skips": 0, "detail": ""},
                {"part": "B", "check": "notebooks/05_ddp.ipynb", "outcome": "skipped",
                 "seconds": 80.1, "skips": 1, "detail": "ran; 1 part skipped: SKIPPED: ..."},
                ...],
     "totals": {"A": {"failed": 0, ...}, "B": {...}, "C": {...}},
     "world_size_1": {"paths": [...], "tests": ["tests/gpu/test_gpu.py::test_...", ...]},
     "results": ["05_train_ddp-world-size-1.json", ...]}

``outcome`` is one of :data:`~ddp_course.harness.gpu_reports.OUTCOMES`: ``failed`` (an
assertion or exception in a test or cell), ``error`` (in a fixture's set-up or tear-down, a
file pytest could not collect, a pass that ended without reports), ``not finished``
(stopped at the time limit), ``passed``, ``skipped`` (the reason in ``detail``: too few
GPUs, world size 1, a notebook's skipped GPU parts, part C), ``not started`` (it did not
fit the time left). ``world_size_1`` (one GPU
only) names the multi-rank nccl paths one GPU cannot exercise and the GPU tests skipped
for that reason. ``results`` lists the JSON files the GPU tests wrote (each script's
``--results``, see :data:`~ddp_course.harness.gpu_check.RESULTS_ENV`), copied next to the
summary; a record of world size 1 gets ``-world-size-1`` in its name.

Exit status: 0 every check of A and B ran and none failed; 1 a check of A or B failed or
errored; 2 no GPU; 3 nothing failed but a check of A or B was not started or not finished.
Part C never changes it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re
import shutil
from collections.abc import Mapping, Sequence

from .gpu_plan import PARTS, WORLD_SIZE_1, WORLD_SIZE_1_PATHS, Plan
from .gpu_reports import OUTCOMES, totals, totals_by_part

SUMMARY_NAME = "gpu_check.json"
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_NOT_FINISHED = 0, 1, 2, 3
KILLED = -9  # a pass's return code when it was stopped at the time limit (run_pytest)


def slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: lower case, every run of
    other characters than letters and digits one dash, none at the ends; ``"unknown"``
    when nothing is left."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def folder_name(gpu_names: Sequence[str]) -> str:
    """The results folder of a machine: ``gpu-<slug of GPU 0's name>``, with ``-x<N>``
    when it has N > 1 GPUs (``gpu-nvidia-h100-80gb-hbm3-x8``), since the nccl checks run
    one rank per GPU.

    Raises:
        ValueError: ``gpu_names`` is empty (a machine without GPUs has no such folder).
    """
    if not gpu_names:
        raise ValueError("no GPU names: a machine without GPUs has no gpu-* folder")
    count = f"-x{len(gpu_names)}" if len(gpu_names) > 1 else ""
    return f"gpu-{slug(gpu_names[0])}{count}"


# pytest's exit codes that say nothing beyond the tests' own reports: all passed,
# some failed, none collected (https://docs.pytest.org/en/stable/reference/exit-codes.html).
_PYTEST_OK_CODES = (0, 1, 5)


def broken_passes(passes: Sequence[Mapping]) -> list[Mapping]:
    """Passes that ended otherwise than pytest does after running its tests (interrupted,
    an internal or usage error), not counting those stopped at the time limit
    (:data:`KILLED`) or never started (``None``)."""
    return [p for p in passes if p["returncode"] not in (None, KILLED, *_PYTEST_OK_CODES)]


def exit_status(checks: Sequence[Mapping], passes: Sequence[Mapping] = ()) -> int:
    """0, 1 or 3 (see the module docstring) from the checks and passes of parts A and B
    (a row without ``part`` counts as A); part C never changes it."""
    checks = [c for c in checks if c.get("part", "A") != "C"]
    passes = [p for p in passes if p.get("part", "A") != "C"]
    count = totals(checks)
    if count["failed"] or count["error"] or broken_passes(passes):
        return EXIT_FAILED
    left_out = count["not started"] or count["not finished"]
    if left_out or any(p["returncode"] in (None, KILLED) for p in passes):
        return EXIT_NOT_FINISHED
    return EXIT_OK


def format_table(checks: Sequence[Mapping], wall_s: float | None = None) -> str:
    """The summary table: ``part  check  outcome  seconds  detail``, one line a check,
    failures in capitals, then one totals line per part that has checks
    (``A: 3 passed, 1 failed``) and the wall time."""
    width = max([len("check"), *(len(c["check"]) for c in checks)])
    lines = [f"part  {'check':<{width}}  {'outcome':<12}  {'seconds':>7}  detail"]
    for c in checks:
        shown = c["outcome"].upper() if c["outcome"] in OUTCOMES[:3] else c["outcome"]
        lines.append(
            f"{c.get('part', 'A'):<4}  {c['check']:<{width}}  {shown:<12}  "
            f"{c['seconds']:7.1f}  {c['detail'][:120]}".rstrip()
        )
    for part in PARTS:
        count = totals([c for c in checks if c.get("part", "A") == part])
        if any(count.values()):
            lines.append(f"{part}: " + ", ".join(f"{n} {o}" for o, n in count.items() if n))
    if not checks:
        lines.append("no checks ran")
    if wall_s is not None:
        lines.append(f"in {wall_s:.0f} s")
    return "\n".join(lines)


def world_size_1_report(gpus: int, checks: Sequence[Mapping]) -> dict | None:
    """On one GPU: the multi-rank nccl paths one GPU cannot exercise, and the GPU tests
    skipped for that reason (skip reasons starting with
    :data:`~ddp_course.harness.gpu_plan.WORLD_SIZE_1`); None with 2 or more GPUs."""
    if gpus != 1:
        return None
    tests = [
        c["check"]
        for c in checks
        if c["outcome"] == "skipped" and c["detail"].startswith(WORLD_SIZE_1)
    ]
    return {"paths": list(WORLD_SIZE_1_PATHS), "tests": tests}


def write_summary(
    folder: pathlib.Path,
    *,
    command: str,
    budget_s: float,
    wall_s: float,
    machine: Mapping,
    passes: Sequence[Mapping],
    checks: Sequence[Mapping],
    results: Sequence[str],
    plan: Plan | None = None,
    utc: str | None = None,
) -> pathlib.Path:
    """Write ``folder/gpu_check.json`` in the shape of the module docstring; its path."""
    gpus = machine.get("gpu_count", 0)
    summary = {
        "command": command,
        "utc": utc or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "wall_s": round(wall_s, 1),
        "gpus": gpus,
        "machine": dict(machine),
        "plan": [dataclasses.asdict(s) for s in plan.steps] if plan is not None else [],
        "passes": list(passes),
        "checks": list(checks),
        "totals": totals_by_part(checks),
        "world_size_1": world_size_1_report(gpus, checks),
        "results": sorted(results),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SUMMARY_NAME
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def result_name(path: pathlib.Path) -> str:
    """The name a results file keeps next to the summary: its own, with ``-world-size-1``
    before ``.json`` when the record's world size (``world_size`` or ``meta.world_size``)
    is 1, so a one-rank "nccl" record never reads as a multi-GPU one."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return path.name
    if not isinstance(data, dict):
        return path.name
    meta = data.get("meta")
    size = data.get("world_size", meta.get("world_size") if isinstance(meta, dict) else None)
    return f"{path.stem}-world-size-1.json" if size == 1 else path.name


def keep_results(source: pathlib.Path, folder: pathlib.Path) -> list[str]:
    """Copy the ``*.json`` files the GPU tests wrote in ``source`` into ``folder`` (named by
    :func:`result_name`) after removing those the previous summary there listed (so no
    stale result is left beside a new summary); the names kept."""
    old = folder / SUMMARY_NAME
    if old.exists():
        try:
            stale = json.loads(old.read_text()).get("results", [])
        except (json.JSONDecodeError, AttributeError):
            stale = []
        for name in stale:
            # Only plain names: a summary cannot make this delete outside its folder.
            if name == pathlib.Path(name).name and name != SUMMARY_NAME:
                (folder / name).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for path in sorted(source.glob("*.json")):
        if path.name != SUMMARY_NAME:
            name = result_name(path)
            shutil.copyfile(path, folder / name)
            names.append(name)
    return names
