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

A check is one GPU test or one notebook (all its cells). The summary it writes, the outcomes
of the checks and the exit status are described in :mod:`ddp_course.harness.gpu_summary`.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import psutil

from .gpu_plan import GRACE_S, PLAN_GPU_COUNTS, Plan, c_reason, format_plan, make_plan
from .gpu_reports import NOT_FINISHED, NOT_STARTED, collect_checks, plugin_args, read_records
from .gpu_summary import (
    EXIT_NO_GPU,
    EXIT_NOT_FINISHED,
    EXIT_OK,
    KILLED,
    broken_passes,
    exit_status,
    folder_name,
    format_table,
    keep_results,
    world_size_1_report,
    write_summary,
)

# Nothing here imports torch at import time (ddp_course.runtime does): every GPU test
# imports RESULTS_ENV from here (tests/gpu_support.py).

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The folder where the GPU tests write the JSON results of the scripts they run.
RESULTS_ENV = "DDP_COURSE_GPU_RESULTS"

Runner = Callable[[Sequence[str], Mapping[str, str], float], int]


# ---------------------------------------------------------------- the machine


def no_gpu_message() -> str:
    """The one line printed where there is no GPU."""
    import torch

    return (
        f"gpu-check: no CUDA GPU is visible here (torch {torch.__version__}, CUDA "
        f"{torch.version.cuda or 'none in this build'}), so nothing was run: run it on a "
        "machine with an NVIDIA GPU."
    )


def machine_info() -> dict:
    """Versions and GPUs of this machine, JSON-ready (the summary's ``machine``, see
    :mod:`ddp_course.harness.gpu_summary`).

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
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def probe_machine() -> dict:
    """:func:`machine_info`, read in this process."""
    import torch

    from .. import runtime

    gpus = []
    for i in range(runtime.gpu_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "name": p.name,
                "memory_GiB": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
            }
        )
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
    killed with everything it started after ``timeout_s`` seconds (returns
    :data:`~ddp_course.harness.gpu_summary.KILLED`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args], cwd=ROOT, env=dict(env), start_new_session=True
    )
    try:
        return proc.wait(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        print(
            f"gpu-check: the pass ran past the time limit; stopping it ({timeout_s:.0f} s)",
            flush=True,
        )
        _kill_tree(proc)
        return KILLED
    finally:
        if proc.poll() is None:
            _kill_tree(proc)


def _row(part: str, check: str, outcome: str, detail: str) -> dict:
    return {
        "part": part,
        "check": check,
        "outcome": outcome,
        "seconds": 0.0,
        "skips": 0,
        "detail": detail,
    }


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
        print(
            f"\ngpu-check: part {step.part}: {shown} (estimate ~{step.estimate_s:.0f} s)",
            flush=True,
        )
        before = len(read_records(reports))
        t0 = time.time()
        code = runner([*plugin_args(reports, deadline), *args], env, hard - time.time())
        passes.append(
            {
                "part": step.part,
                "what": step.check,
                "command": shown,
                "returncode": code,
                "seconds": round(time.time() - t0, 1),
            }
        )
        found = collect_checks(read_records(reports)[before:])
        rows += [{"part": step.part, **c} for c in found]
        if not found:
            outcome = "not finished" if code == KILLED else "error"
            detail = NOT_FINISHED if code == KILLED else f"pytest exit code {code}, no report"
            rows.append(_row(step.part, step.check, outcome, detail))
    return passes, rows


def dry_run(
    counts: Sequence[int] = PLAN_GPU_COUNTS, budget_s: float | None = None, run_all: bool = False
) -> int:
    """Print the plan for each GPU count in ``counts`` and run nothing; returns 0. Needs no
    GPU (the plans come from the notebooks' and tests' source)."""
    for i, n in enumerate(counts):
        print(("\n" if i else "") + format_plan(make_plan(n, budget_s, run_all=run_all)))
    print(
        "\ndry run: nothing was run. Exit status of a real run: 0 every check of A and B "
        "ran and passed; 1 a real failure; 2 no GPU; 3 a check of A or B not started or "
        "not finished (part C never changes it)."
    )
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
    folder = (
        out
        if out is not None
        else ROOT / "benchmarks" / folder_name([g["name"] for g in machine["gpus"]])
    )
    names = ", ".join(g["name"] for g in machine["gpus"])
    print(
        f"gpu-check: {gpus} GPU(s) ({names}); torch {machine['torch']}, CUDA "
        f"{machine['cuda']}; summary in {_shown(folder)}",
        flush=True,
    )
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
    path = write_summary(
        folder,
        command=command,
        budget_s=plan.budget_s,
        wall_s=wall_s,
        machine=machine,
        passes=passes,
        checks=checks,
        results=kept,
        plan=plan,
    )
    print("\n" + format_table(checks, wall_s))
    print(f"summary: {_shown(path)}" + (f" with {len(kept)} result file(s)" if kept else ""))
    for p in broken_passes(passes):
        print(
            f"the pass '{p['what']}' ended with pytest's exit code {p['returncode']}: "
            "see its output above"
        )
    ws1 = world_size_1_report(gpus, checks)
    if ws1 is not None:
        print(
            "world size 1: one GPU could not exercise these multi-rank nccl paths: "
            + "; ".join(ws1["paths"])
        )
    status = exit_status(checks, passes)
    if status == EXIT_NOT_FINISHED:
        print(
            f"exit 3: a check of A or B was not started or not finished within the budget "
            f"of {plan.budget_s:.0f} s (--budget-s gives more; see the plan above)"
        )
    return status


def _shown(path: pathlib.Path) -> str:
    try:
        return str(path.resolve().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)
