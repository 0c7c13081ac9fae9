"""What ``python -m ddp_course gpu-check`` runs on a machine with N GPUs, in what order, and
how long it should take: the plan, made without a GPU (``--dry-run`` prints it).

Three parts, ordered by what only a GPU can show:

- **A**, the GPU tests: every ``tests/gpu/test_*.py``, one pytest process per file (a file's
  tests that hold a CUDA context in the pytest process would keep the next file's torchrun
  ranks off GPU 0 on GPUs in exclusive-process mode), one test at a time. Estimate: the
  tests that run with N GPUs (those not marked ``needs_2_gpus``/``needs_4_gpus`` beyond N,
  counted from the files' source) x :data:`GPU_TEST_S`, plus :data:`PYTEST_START_S` a file.
- **B**, the notebooks with a CUDA path with N GPUs (:func:`ddp_course.harness.launch_scan.
  cuda_notebooks`), cheapest first by recorded time, one at a time (no pytest-xdist on the
  GPUs). Estimate: the notebook's recorded time (the sum of its code cells' ``execution``
  timestamps, from the clean run that stored its outputs on a 2-core CPU machine) x
  :data:`MARGIN` + :data:`NOTEBOOK_START_S`. Each starts only if its estimate fits the time
  left, so none is cut off by the plan.
- **C**, the rest: ``skipped: no CUDA path with N GPU(s); `make test` runs it``; run only with
  ``--all`` (whose default budget fits every check), or when time is left after B
  (cheapest first, same rule).

The budget (:func:`default_budget`) is 540 s with 1-3 GPUs, so that with :data:`GRACE_S`
the whole check ends within 10 minutes; with 4 or more GPUs nearly every notebook has a CUDA
path and the default is :data:`BUDGET_S_4_GPUS`.

Nothing here imports torch at import time: pytest loads :mod:`.gpu_check` (which imports
this) as a plugin into every pass.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import json
import math
import pathlib
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUDGET_S = 540.0  # nothing new starts after 9 minutes ...
GRACE_S = 60.0  # ... and whatever runs is stopped a minute later: 10 minutes in all
BUDGET_S_4_GPUS = 1800.0  # 4+ GPUs: the notebooks' recorded times alone are about 12 minutes
MARGIN = 1.25  # a notebook's recorded time x this, for a host slower than the recording
NOTEBOOK_START_S = 10.0  # a pytest process and a Jupyter kernel started for each notebook
GPU_TEST_S = 15.0  # one GPU test: a torchrun job on tiny settings, mostly process start-up
PYTEST_START_S = 10.0  # a pytest process collecting one GPU test file
PLAN_GPU_COUNTS = (1, 2, 4)
PARTS = ("A", "B", "C")
# The prefix of every skip reason of a GPU test that world size 1 cannot exercise; gpu-check
# lists those tests in its summary.
WORLD_SIZE_1 = "world size 1"
# What a single GPU cannot show about nccl: every nccl job there has one rank.
WORLD_SIZE_1_PATHS = (
    "all_reduce and every other collective between GPUs: with one rank, a local copy",
    "busbw of the benchmark sweep: 0 by definition for every collective but broadcast",
    "point-to-point sends between GPUs (pipeline stages, ring attention, ring all-reduce)",
    "SyncBatchNorm across GPUs: one rank is plain BatchNorm",
    "FSDP2 and ZeRO sharding across GPUs, and a sharded checkpoint loaded on fewer GPUs",
    "all_to_all with uneven splits (expert parallelism) and 2-D device meshes",
    "DataParallel with a replica on each GPU",
)
_NEEDS = {"needs_gpu": 1, "needs_2_gpus": 2, "needs_4_gpus": 4}


def default_budget(gpus: int) -> float:
    """Seconds after which no new check starts: :data:`BUDGET_S` with fewer than 4 GPUs,
    :data:`BUDGET_S_4_GPUS` with 4 or more."""
    return BUDGET_S_4_GPUS if gpus >= 4 else BUDGET_S


def recorded_seconds(path: pathlib.Path) -> float:
    """Seconds a notebook's code cells took in the run that stored its outputs: the sum of
    ``shell.execute_reply - iopub.execute_input`` of each cell's ``execution`` metadata
    (what JupyterLab and nbclient store); cells without it count 0."""
    total = 0.0
    for cell in json.loads(pathlib.Path(path).read_text())["cells"]:
        times = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in times and "shell.execute_reply" in times:
            start = datetime.datetime.fromisoformat(times["iopub.execute_input"])
            end = datetime.datetime.fromisoformat(times["shell.execute_reply"])
            total += max((end - start).total_seconds(), 0.0)
    return total


def _min_gpus(decorators: Sequence[ast.AST]) -> int:
    def needs(d: ast.AST) -> int:
        if isinstance(d, ast.Call):  # ``@world_size_1("...")``: skipped on exactly one GPU
            return 2 if getattr(d.func, "id", None) == "world_size_1" else 0
        return _NEEDS.get(getattr(d, "id", None), 0)

    return max([0, *(needs(d) for d in decorators)])


def _cases(decorators: Sequence[ast.AST]) -> int:
    """Parametrized cases of a test from its ``parametrize`` decorators' literal lists."""
    count = 1
    for d in decorators:
        if isinstance(d, ast.Call) and getattr(d.func, "attr", None) == "parametrize":
            values = d.args[1] if len(d.args) > 1 else None
            if isinstance(values, ast.List | ast.Tuple):
                count *= max(len(values.elts), 1)
    return count


def count_gpu_tests(path: pathlib.Path, gpus: int) -> tuple[int, int]:
    """``(run, total)``: tests of a GPU test file that run with ``gpus`` GPUs, and all of them,
    from its source: ``test_*`` functions, parametrized cases of literal lists, and the
    skip marks ``needs_gpu``/``needs_2_gpus``/``needs_4_gpus`` of ``tests/gpu_support.py`` on
    the test or as the module's ``pytestmark``, and ``@world_size_1(...)`` (skipped on one
    GPU, see ``tests/gpu/test_gpu.py``)."""
    tree = ast.parse(pathlib.Path(path).read_text())
    module_needs = 0
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "pytestmark" for t in node.targets
        ):
            marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
            module_needs = _min_gpus(marks)
    run = total = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            cases = _cases(node.decorator_list)
            total += cases
            if max(module_needs, _min_gpus(node.decorator_list)) <= gpus:
                run += cases
    return run, total


@dataclasses.dataclass(frozen=True)
class Step:
    """One check of the plan.

    Attributes:
        part: ``"A"``, ``"B"`` or ``"C"``.
        check: a GPU test file or a notebook, relative to the repository root.
        estimate_s: seconds it should take.
        how: how the estimate was made, in words.
        fits: its estimate fits the budget after those of the steps before it that fit
            (a step of C that fits runs in the time B leaves; a GPU test file that does not
            fit starts all the same, and its tests stop starting at the budget).
    """

    part: str
    check: str
    estimate_s: float
    how: str
    fits: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """The order and estimates of one gpu-check on ``gpus`` GPUs (see the module docstring).

    Attributes:
        gpus: GPUs the plan is for.
        budget_s: seconds after which no new check starts.
        steps: every check, in the order it would run (C last).
        run_all: part C is part of the run (``--all``): a C step that does not fit is
            ``not started``, not ``skipped``.
        nccl: the notebooks that start an nccl job of 2 or more ranks with ``gpus`` GPUs.
    """

    gpus: int
    budget_s: float
    steps: tuple[Step, ...]
    run_all: bool = False
    nccl: tuple[str, ...] = ()

    def part(self, name: str) -> list[Step]:
        """The steps of part ``name`` in order."""
        return [s for s in self.steps if s.part == name]

    def estimate_s(self) -> float:
        """Seconds of everything of A and B that fits, and of C where it runs."""
        return sum(s.estimate_s for s in self.steps if s.fits)

    def needed_s(self) -> float:
        """Seconds of all of A and B: the budget under which all of them start."""
        return sum(s.estimate_s for s in self.steps if s.part != "C")


def make_plan(
    gpus: int, budget_s: float | None = None, root: pathlib.Path = ROOT, run_all: bool = False
) -> Plan:
    """The plan for a machine with ``gpus`` GPUs (see the module docstring).

    Args:
        gpus: GPUs, at least 1.
        budget_s: seconds after which nothing new starts; default :func:`default_budget`.
        root: the repository (``tests/gpu/``, ``notebooks/``).
        run_all: plan part C as part of the run (``--all``); without ``budget_s`` the
            budget grows to the estimate of every check, rounded up to a minute.

    Raises:
        ValueError: ``gpus`` < 1, or a notebook launch the scan cannot read.
    """
    from . import launch_scan  # imports torch: not at import time (see the module docstring)

    if gpus < 1:
        raise ValueError(f"a gpu-check plan needs at least 1 GPU, not {gpus}")
    checks: list[tuple[str, str, float, str]] = []  # part, check, estimate, how
    for path in sorted((root / "tests" / "gpu").glob("test_*.py")):
        run, total = count_gpu_tests(path, gpus)
        how = f"{run} of {total} tests run with {gpus} GPU(s), {GPU_TEST_S:g} s each"
        checks.append(("A", f"tests/gpu/{path.name}", PYTEST_START_S + run * GPU_TEST_S, how))
    launches = launch_scan.scan(root / "notebooks")
    cuda = set(launch_scan.cuda_notebooks(launches, gpus))
    notebooks = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    recorded = {p.name: recorded_seconds(p) for p in notebooks}
    order = sorted(notebooks, key=lambda p: (recorded[p.name], p.name))
    for part in ("B", "C"):
        for p in order:
            if (p.name in cuda) == (part == "B"):
                how = f"recorded {recorded[p.name]:.0f} s x {MARGIN:g} + {NOTEBOOK_START_S:g} s"
                estimate = recorded[p.name] * MARGIN + NOTEBOOK_START_S
                checks.append((part, f"notebooks/{p.name}", estimate, how))
    budget = default_budget(gpus) if budget_s is None else budget_s
    if run_all and budget_s is None:  # --all: a budget that fits every check
        budget = max(budget, float(math.ceil(sum(c[2] for c in checks) / 60) * 60))
    steps, used = [], 0.0
    for part, check, estimate, how in checks:
        fits = used + estimate <= budget
        used += estimate if fits else 0.0
        steps.append(Step(part, check, round(estimate, 1), how, fits))
    nccl = tuple(launch_scan.nccl_notebooks(launches, gpus))
    return Plan(gpus, budget, tuple(steps), run_all, nccl)


def c_reason(gpus: int) -> str:
    """The row text of a part C notebook that did not run."""
    return f"skipped: no CUDA path with {gpus} GPU(s); `make test` runs it"


def format_plan(plan: Plan) -> str:
    """The plan as printed before a run and by ``--dry-run``: each part, its checks in order
    with their estimates and whether they fit, the total, and what it cannot show."""
    n = plan.gpus
    lines = [
        f"gpu-check plan with {n} GPU(s): budget {plan.budget_s:.0f} s (nothing new starts "
        f"later; whatever runs is stopped {GRACE_S:.0f} s after it)",
        "A  GPU tests: every tests/gpu/test_*.py, one pytest process per file, one test at a time",
    ]
    clock = 0.0

    def row(step: Step, label: str) -> str:
        nonlocal clock
        if step.fits:
            text = f"~{step.estimate_s:5.0f} s  starts at ~{clock:4.0f} s"
            clock += step.estimate_s
        elif step.part == "A":  # a test file starts anyway; its tests stop at the budget
            text = f"~{step.estimate_s:5.0f} s  past the budget: tests left then not started"
        else:
            text = f"~{step.estimate_s:5.0f} s  does not fit: not started (exit 3)"
        return f"   {label}{step.check:<44} {text}  ({step.how})"

    lines += [row(s, "") for s in plan.part("A")]
    lines.append(
        f"B  notebooks with a CUDA path with {n} GPU(s), cheapest first, one at a time; each "
        f"starts only if recorded time x {MARGIN:g} + {NOTEBOOK_START_S:g} s fits the time left"
    )
    lines += [row(s, f"{i:2}. ") for i, s in enumerate(plan.part("B"), 1)] or ["   (none)"]
    part_c = plan.part("C")
    if plan.run_all:
        lines.append("C  the other notebooks (--all): after B, cheapest first, same rule")
        lines += [row(s, "") for s in part_c]
    else:
        names = ", ".join(pathlib.Path(s.check).stem for s in part_c) or "none"
        lines.append(f"C  {c_reason(n)}: {names} (--all runs them; so does time left after B)")
    late = [s for s in plan.steps if s.part != "C" and not s.fits]
    lines.append(
        f"estimated {plan.estimate_s():.0f} s for what fits the {plan.budget_s:.0f} s budget"
        + (
            f"; {len(late)} check(s) of A and B do not fit and would be reported not started "
            f"(exit 3): --budget-s {plan.needed_s() + 30:.0f} starts them all"
            if late
            else "; every check of A and B fits"
        )
    )
    if n == 1:
        lines.append(
            "world size 1: with one GPU every nccl job has one rank, so these multi-rank nccl "
            "paths cannot be exercised here (2+ GPUs can):"
        )
        lines += [f"   - {p}" for p in WORLD_SIZE_1_PATHS]
    if n >= 4:
        lines.append(
            f"{n} GPUs: {len(plan.nccl)} notebooks start nccl jobs of 2 or more ranks, so the "
            f"default budget is {BUDGET_S_4_GPUS:.0f} s, not {BUDGET_S:.0f} s (a smaller "
            "--budget-s leaves the dearest notebooks of B not started)"
        )
    return "\n".join(lines)
