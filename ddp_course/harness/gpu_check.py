"""``python -m ddp_course gpu-check`` (``make gpu-check``): the course's GPU paths, checked on
this machine's GPUs, in the order of what only a GPU can show, with a record of what ran.

It first prints the plan (:mod:`ddp_course.harness.gpu_plan`: order, estimates, budget),
then runs it from the repository root:

- **A**, the GPU tests: every ``tests/gpu/test_*.py``, one pytest process per file;
- **B**, the notebooks with a CUDA path with this many GPUs, cheapest first, one pytest
  process each (no pytest-xdist on the GPUs), each started only if its estimate fits the
  time left;
- **C**, the other notebooks: a row ``skipped: no CUDA path with N GPU(s); `make test` runs
  it``; they run with ``--all``, or when their estimate fits the time B left.

``--dry-run`` prints the plans for 1, 2 and 4 GPUs (or ``--gpus N``) and runs nothing; it
needs no GPU. Without ``--dry-run`` on a machine without a CUDA GPU it prints one line and
returns 2.

Outcomes come from pytest's own reports, not from its printed text: the pytest plugin of
:mod:`ddp_course.harness.gpu_reports`, loaded into every pass, appends every test report to
a JSON-lines file as it arrives, so the outcomes of a pass stopped at the time limit are kept
too. For a notebook cell it also keeps the lines its output starts with ``skipped`` or
``SKIPPED`` (read from nbval's ``test_outputs``): a notebook that ran and printed such lines
is reported ``skipped``, with their count and the first of them, never ``passed``. The
plugin starts no test after the budget; a notebook already started runs on. Whatever runs
:data:`GRACE_S` seconds after the budget is killed with everything it started and reported
``not finished``.

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

``outcome`` is one of :data:`OUTCOMES`: ``failed`` (an assertion or exception in a test or
cell), ``error`` (in a fixture's set-up or tear-down, a file pytest could not collect, a
pass that ended without reports), ``not finished`` (stopped at the time limit), ``passed``,
``skipped`` (the reason in ``detail``: too few GPUs, world size 1, a notebook's skipped GPU
parts, part C), ``not started`` (it did not fit the time left). ``world_size_1`` (one GPU
only) names the multi-rank nccl paths one GPU cannot exercise and the GPU tests skipped
for that reason. ``results`` lists the JSON files the GPU tests wrote (each script's
``--results``, see :data:`RESULTS_ENV`), copied next to the summary; a record of world size
1 gets ``-world-size-1`` in its name.

Exit status: 0 every check of A and B ran and none failed; 1 a check of A or B failed or
errored; 2 no GPU; 3 nothing failed but a check of A or B was not started or not finished.
Part C never changes it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import psutil

from .gpu_plan import (
    GRACE_S,
    PARTS,
    PLAN_GPU_COUNTS,
    WORLD_SIZE_1,
    WORLD_SIZE_1_PATHS,
    Plan,
    c_reason,
    format_plan,
    make_plan,
)
from .gpu_reports import (
    NOT_FINISHED,
    NOT_STARTED,
    OUTCOMES,
    collect_checks,
    plugin_args,
    read_records,
    totals,
    totals_by_part,
)

# Nothing here imports torch at import time (ddp_course.runtime does): every GPU test
# imports RESULTS_ENV from here (tests/gpu_support.py).

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The folder where the GPU tests write the JSON results of the scripts they run.
RESULTS_ENV = "DDP_COURSE_GPU_RESULTS"
SUMMARY_NAME = "gpu_check.json"
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_NOT_FINISHED = 0, 1, 2, 3
KILLED = -9  # run_pytest's return code for a pass stopped at the time limit

Runner = Callable[[Sequence[str], Mapping[str, str], float], int]


# ---------------------------------------------------------------- names


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


def no_gpu_message() -> str:
    """The one line printed where there is no GPU."""
    import torch

    return (
        f"gpu-check: no CUDA GPU is visible here (torch {torch.__version__}, CUDA "
        f"{torch.version.cuda or 'none in this build'}), so nothing was run: run it on a "
        "machine with an NVIDIA GPU."
    )


def machine_info() -> dict:
    """Versions and GPUs of this machine, JSON-ready (see the module docstring).

    Read by a child process (:func:`probe_machine`), so that this one never holds a
    CUDA context while the checks run: on GPUs in exclusive-process mode the ranks
    could not use GPU 0 then.

    Raises:
        subprocess.CalledProcessError: the child failed (torch cannot be imported).
    """
    code = (
        "import json; from ddp_course.harness.gpu_check import probe_machine as p; "
        "print(json.dumps(p()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def probe_machine() -> dict:
    """:func:`machine_info`, read in this process."""
    import torch

    from .. import runtime

    gpus = []
    for i in range(runtime.gpu_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"name": p.name, "memory_GiB": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"})  # fmt: skip
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without nccl, or one whose version call fails
        nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "cpu_count": os.cpu_count(),
        "gpu_count": len(gpus),
        "gpus": gpus,
    }


# pytest's exit codes that say nothing beyond the tests' own reports: all passed,
# some failed, none collected (https://docs.pytest.org/en/stable/reference/exit-codes.html).
_PYTEST_OK_CODES = (0, 1, 5)


def broken_passes(passes: Sequence[Mapping]) -> list[Mapping]:
    """Passes that ended otherwise than pytest does after running its tests (interrupted,
    an internal or usage error), not counting those stopped at the time limit
    (:data:`KILLED`) or never started (``None``)."""
    return [p for p in passes
            if p["returncode"] not in (None, KILLED, *_PYTEST_OK_CODES)]  # fmt: skip


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
        lines.append(f"{c.get('part', 'A'):<4}  {c['check']:<{width}}  {shown:<12}  "
                     f"{c['seconds']:7.1f}  {c['detail'][:120]}".rstrip())  # fmt: skip
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
    tests = [c["check"] for c in checks
             if c["outcome"] == "skipped" and c["detail"].startswith(WORLD_SIZE_1)]  # fmt: skip
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


# ---------------------------------------------------------------- running


def pass_args(check: str) -> list[str]:
    """pytest arguments of one step of the plan (a GPU test file or a notebook), run from
    the repository root; the plugin's options come on top (see :func:`plugin_args`)."""
    # A file that cannot be collected is reported as an error row, not a stopped pass.
    return ["--continue-on-collection-errors", check]


def _kill_tree(proc: subprocess.Popen) -> None:
    # torchrun puts its workers in sessions of their own: a process group kill
    # misses them, so kill every descendant by pid.
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [*tree]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.kill()
    psutil.wait_procs(tree, timeout=10)
    proc.wait()


def run_pytest(args: Sequence[str], env: Mapping[str, str], timeout_s: float) -> int:
    """``python -m pytest *args`` in the repository root, its output on this terminal;
    killed with everything it started after ``timeout_s`` seconds (returns :data:`KILLED`)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=dict(env),
                            start_new_session=True)  # fmt: skip
    try:
        return proc.wait(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        print(f"gpu-check: the pass ran past the time limit; stopping it ({timeout_s:.0f} s)",
              flush=True)  # fmt: skip
        _kill_tree(proc)
        return KILLED
    finally:
        if proc.poll() is None:
            _kill_tree(proc)


def _row(part: str, check: str, outcome: str, detail: str) -> dict:
    return {"part": part, "check": check, "outcome": outcome, "seconds": 0.0, "skips": 0,
            "detail": detail}  # fmt: skip


def run_plan(
    plan: Plan,
    runner: Runner,
    env: Mapping[str, str],
    reports: pathlib.Path,
    start: float,
    notebooks: bool = True,
) -> tuple[list[dict], list[dict]]:
    """Run the plan's steps in order; ``(passes, checks)``, every check with its ``part``.

    A GPU test file starts whatever its estimate while there is time before the budget (its
    tests stop starting at the budget), else it is one row ``not started``;
    a notebook of B starts only if its estimate fits the time left before the budget,
    else it is ``not started``; one of C the same way, and only with ``plan.run_all`` or
    time left, else ``skipped`` (:func:`~ddp_course.harness.gpu_plan.c_reason`). Every pass
    is stopped :data:`GRACE_S` after the budget. A pass that left no report of a check it
    began is a row ``not finished`` (stopped) or ``error`` (any other exit).
    """
    deadline, hard = start + plan.budget_s, start + plan.budget_s + GRACE_S
    passes: list[dict] = []
    rows: list[dict] = []
    for step in plan.steps:
        if step.part != "A" and not notebooks:
            continue
        left = deadline - time.time()
        if step.part == "A" and left <= 0:  # each of its tests would be skipped unstarted
            rows.append(_row("A", step.check, "not started", NOT_STARTED))
            continue
        if step.part != "A" and step.estimate_s > left:
            if step.part == "C" and not plan.run_all:
                rows.append(_row("C", step.check, "skipped", c_reason(plan.gpus)))
            else:
                why = f"{NOT_STARTED}: needs ~{step.estimate_s:.0f} s, {max(left, 0):.0f} s left"
                rows.append(_row(step.part, step.check, "not started", why))
            continue
        args = pass_args(step.check)
        shown = shlex.join(["python", "-m", "pytest", *args])
        print(f"\ngpu-check: part {step.part}: {shown} (estimate ~{step.estimate_s:.0f} s)",
              flush=True)  # fmt: skip
        before = len(read_records(reports))
        t0 = time.time()
        code = runner([*plugin_args(reports, deadline), *args], env, hard - time.time())
        passes.append({"part": step.part, "what": step.check, "command": shown,
                       "returncode": code, "seconds": round(time.time() - t0, 1)})  # fmt: skip
        found = collect_checks(read_records(reports)[before:])
        rows += [{"part": step.part, **c} for c in found]
        if not found:
            outcome = "not finished" if code == KILLED else "error"
            detail = NOT_FINISHED if code == KILLED else f"pytest exit code {code}, no report"
            rows.append(_row(step.part, step.check, outcome, detail))
    return passes, rows


def dry_run(counts: Sequence[int] = PLAN_GPU_COUNTS, budget_s: float | None = None,
            run_all: bool = False) -> int:  # fmt: skip
    """Print the plan for each GPU count in ``counts`` and run nothing; returns 0. Needs no
    GPU (the plans come from the notebooks' and tests' source)."""
    for i, n in enumerate(counts):
        print(("\n" if i else "") + format_plan(make_plan(n, budget_s, run_all=run_all)))
    print("\ndry run: nothing was run. Exit status of a real run: 0 every check of A and B "
          "ran and passed; 1 a real failure; 2 no GPU; 3 a check of A or B not started or "
          "not finished (part C never changes it).")  # fmt: skip
    return EXIT_OK


def gpu_check(
    budget_s: float | None = None,
    out: pathlib.Path | None = None,
    notebooks: bool = True,
    runner: Runner = run_pytest,
    command: str = "python -m ddp_course gpu-check",
    run_all: bool = False,
) -> int:
    """Print the plan, run it, write the summary and print the table; the exit status.

    Args:
        budget_s: seconds after which no new check starts (default
            :func:`~ddp_course.harness.gpu_plan.default_budget` of the GPU count);
            whatever runs is stopped :data:`GRACE_S` seconds later.
        out: the results folder; default ``benchmarks/<folder_name(GPUs)>``.
        notebooks: also run the notebooks (parts B and C); False runs part A only.
        runner: runs one pass (``run_pytest``; tests pass a fake).
        command: the command line recorded in the summary.
        run_all: run part C whatever the time.

    Returns:
        :data:`EXIT_NO_GPU` without a GPU (one line printed, nothing run), else
        :func:`exit_status` of the checks.
    """
    from .. import runtime

    gpus = runtime.gpu_count()
    if gpus == 0:
        print(no_gpu_message(), flush=True)
        return EXIT_NO_GPU
    plan = make_plan(gpus, budget_s, run_all=run_all)
    start = time.time()
    machine = machine_info()
    folder = out if out is not None else ROOT / "benchmarks" / folder_name(
        [g["name"] for g in machine["gpus"]]
    )  # fmt: skip
    names = ", ".join(g["name"] for g in machine["gpus"])
    print(f"gpu-check: {gpus} GPU(s) ({names}); torch {machine['torch']}, CUDA "
          f"{machine['cuda']}; summary in {_shown(folder)}", flush=True)  # fmt: skip
    print(format_plan(plan), flush=True)
    with tempfile.TemporaryDirectory(prefix="ddp_course_gpu_check_") as tmp:
        reports, results = pathlib.Path(tmp, "reports.jsonl"), pathlib.Path(tmp, "results")
        results.mkdir()
        # The launcher's device plan decides, not a DDP_COURSE_DEVICE left in the shell.
        env = {k: v for k, v in os.environ.items() if k != runtime.DEVICE_ENV}
        env[RESULTS_ENV] = str(results)
        passes, checks = run_plan(plan, runner, env, reports, start, notebooks)
        kept = keep_results(results, folder)
    wall_s = time.time() - start
    path = write_summary(folder, command=command, budget_s=plan.budget_s, wall_s=wall_s,
                         machine=machine, passes=passes, checks=checks, results=kept,
                         plan=plan)  # fmt: skip
    print("\n" + format_table(checks, wall_s))
    print(f"summary: {_shown(path)}" + (f" with {len(kept)} result file(s)" if kept else ""))
    for p in broken_passes(passes):
        print(f"the pass '{p['what']}' ended with pytest's exit code {p['returncode']}: "
              "see its output above")  # fmt: skip
    ws1 = world_size_1_report(gpus, checks)
    if ws1 is not None:
        print("world size 1: one GPU could not exercise these multi-rank nccl paths: "
              + "; ".join(ws1["paths"]))  # fmt: skip
    status = exit_status(checks, passes)
    if status == EXIT_NOT_FINISHED:
        print(f"exit 3: a check of A or B was not started or not finished within the budget "
              f"of {plan.budget_s:.0f} s (--budget-s gives more; see the plan above)")  # fmt: skip
    return status


def _shown(path: pathlib.Path) -> str:
    try:
        return str(path.resolve().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)
