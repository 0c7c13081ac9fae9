"""``python -m ddp_course gpu-check`` (``make gpu-check``): the course's GPU paths, checked on
this machine's GPUs, with a record of what ran.

On a machine without a CUDA GPU it prints one line saying so and returns 2; nothing runs.
Otherwise it runs three pytest passes from the repository root, as ``make test`` runs
notebooks (see the Makefile):

1. ``tests/gpu/test_gpu.py``: nccl with one rank per GPU, the CPU fallback with more ranks
   than GPUs, DataParallel (torch's and the course's), autocast with GradScaler,
   SyncBatchNorm, the pipeline's CUDA clock, FSDP2, the benchmark's nccl sweep;
2. the notebooks that may run beside others (those ``tests/conftest.py`` does not mark
   ``serial``) on two pytest-xdist workers;
3. the other notebooks, one at a time.

Outcomes come from pytest's own reports, not from its printed text: this module is also
a pytest plugin (``-p ddp_course.harness.gpu_check``) that appends every test report to a
JSON-lines file as it arrives, so the outcomes of a pass stopped at the time limit are
kept too. The plugin also stops starting checks once the time budget is spent: a test,
or a notebook's first cell, that would start later is skipped with the reason
:data:`NOT_STARTED`; a notebook already started runs to its end. Every pass is killed,
with everything it started, :data:`GRACE_S` seconds after the budget, so the whole
command takes at most ``budget_s + GRACE_S`` seconds and a few more to read the machine
and write the summary; the checks a killed pass had not begun are not listed.

A check is one test of ``tests/gpu/test_gpu.py`` or one notebook (all its cells). The
summary goes to ``benchmarks/gpu-<GPU name>[-x<N>]/gpu_check.json`` (see
:func:`folder_name`)::

    {"command": "python -m ddp_course gpu-check --budget-s 540",
     "utc": "2026-11-23T09:00:00+00:00", "budget_s": 540, "wall_s": 312.4,
     "machine": {"python": "3.12.3", "torch": "2.13.0+cu128", "cuda": "12.8",
                 "cudnn": 91002, "nccl": "2.27.5", "cpu_count": 16, "gpu_count": 1,
                 "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_GiB": 79.2,
                           "capability": "9.0"}]},
     "passes": [{"what": "GPU tests", "command": "python -m pytest ...",
                 "returncode": 0, "seconds": 101.2}, ...],
     "checks": [{"check": "tests/gpu/test_gpu.py::test_fsdp2_on_gpus", "outcome": "passed",
                 "seconds": 14.2, "detail": ""},
                {"check": "notebooks/05_ddp.ipynb", "outcome": "failed", "seconds": 80.1,
                 "detail": "AssertionError: ..."}, ...],
     "totals": {"failed": 1, "error": 0, "unfinished": 0, "passed": 20, "skipped": 1,
                "not started": 0},
     "results": ["05_train_ddp.json", ...]}

``outcome`` is one of :data:`OUTCOMES`: ``failed`` (an assertion or exception in a test
or cell), ``error`` (in a fixture's set-up or tear-down, or a file pytest could not
collect), ``unfinished`` (killed at the time limit), ``passed``, ``skipped`` (the reason
in ``detail``, e.g. too few GPUs), ``not started`` (the budget was spent). ``results``
lists the JSON files the GPU tests wrote (each script's ``--results``), copied next to
the summary; the tests write them into the folder named by :data:`RESULTS_ENV`. The
same rows are printed as a table (:func:`format_table`), one line a check, then the
totals.

Exit status: 0 every check ran and none failed; 1 a check failed, errored or was
stopped unfinished; 2 no GPU; 3 nothing failed but the budget left checks not started.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterable, Mapping, Sequence

import psutil
import pytest

# Nothing here imports torch at import time (ddp_course.runtime does): pytest loads this
# module as a plugin into every pass and every xdist worker, most of which never need it.

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The folder where tests/gpu/test_gpu.py writes the JSON results of the scripts it runs.
RESULTS_ENV = "DDP_COURSE_GPU_RESULTS"
SUMMARY_NAME = "gpu_check.json"
BUDGET_S = 540.0  # nothing new starts after 9 minutes ...
GRACE_S = 60.0  # ... and every pass is killed a minute later: 10 minutes in all
NOT_STARTED = "not started: the time budget of gpu-check was spent"
# Worst first: a check's outcome is the worst of its tests' (a notebook's cells').
OUTCOMES = ("failed", "error", "unfinished", "passed", "skipped", "not started")
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_NOT_STARTED = 0, 1, 2, 3

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


# ---------------------------------------------------------------- pytest plugin


def pytest_addoption(parser: pytest.Parser) -> None:
    """pytest hook: the plugin's options (where to append reports, the deadline)."""
    group = parser.getgroup("gpu-check", "python -m ddp_course gpu-check")
    group.addoption("--gpu-check-reports", help="append every test report here (JSON lines)")
    group.addoption("--gpu-check-deadline", type=float,
                    help="time.time() after which no new check starts")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """pytest hook: register the report writer and the deadline when the options are given."""
    reports = config.getoption("gpu_check_reports")
    deadline = config.getoption("gpu_check_deadline")
    if reports or deadline is not None:
        # Under pytest-xdist the workers run the tests and the controller receives
        # every report: workers apply the deadline, only the controller writes.
        worker = hasattr(config, "workerinput")
        config.pluginmanager.register(
            _Plugin(None if worker else reports, deadline), "ddp-course-gpu-check"
        )


class _Plugin:
    def __init__(self, reports: str | None, deadline: float | None):
        self.reports = pathlib.Path(reports) if reports else None
        self.deadline = deadline
        self.started: set[str] = set()  # checks (test ids, notebook files) begun

    @pytest.hookimpl(tryfirst=True)  # before any fixture or notebook kernel is set up
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        name = check_name(item.nodeid)
        if name in self.started or self.deadline is None:
            self.started.add(name)
            return
        if time.time() > self.deadline:
            pytest.skip(NOT_STARTED)
        self.started.add(name)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write(report_record(report))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # a notebook or test file that cannot even be collected
            self._write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed",
                         "seconds": 0.0, "detail": _last_line(report.longreprtext)})  # fmt: skip

    def _write(self, record: dict) -> None:
        if self.reports is None:
            return
        with self.reports.open("a") as f:  # one line at a time: a killed pass keeps its lines
            f.write(json.dumps(record) + "\n")


def report_record(report: pytest.TestReport) -> dict:
    """One phase of one test as a JSON-ready dict: ``nodeid``, ``when`` (setup, call,
    teardown), ``outcome`` (passed, failed, skipped), ``seconds`` and ``detail`` (the
    skip reason, or the last line of the failure)."""
    detail = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        detail = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        # A Python test's crash line ("AssertionError: ..."); nbval's report of a cell is
        # text that ends with the kernel's traceback, whose last line names the exception.
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else ""
        detail = text.splitlines()[0][:300] if text.strip() else _last_line(report.longreprtext)
    return {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "seconds": report.duration, "detail": detail}  # fmt: skip


def _last_line(text: str) -> str:
    # The end of a traceback names the exception; kernels colour theirs.
    lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else "failed"


# ---------------------------------------------------------------- collecting


def check_name(nodeid: str) -> str:
    """A notebook's cells are one check (its file); any other test is a check of its own."""
    path = nodeid.split("::", 1)[0]
    return path if path.endswith(".ipynb") else nodeid


def _test_outcome(phases: Sequence[Mapping]) -> tuple[str, str]:
    for p in phases:
        if p["outcome"] == "failed":
            return ("failed" if p["when"] == "call" else "error"), p["detail"]
    for p in phases:
        if p["outcome"] == "skipped":
            return ("not started" if p["detail"] == NOT_STARTED else "skipped"), p["detail"]
    if not any(p["when"] == "call" for p in phases):
        return "unfinished", "stopped at gpu-check's time limit"
    return "passed", ""


def collect_checks(records: Iterable[Mapping]) -> list[dict]:
    """Reports (:func:`report_record` dicts) -> one row per check, in the order they ran.

    A test's outcome comes from its phases (a failure in ``call`` is ``failed``, in
    set-up or tear-down ``error``; set up but never called is ``unfinished``); a check's
    is the worst of its tests' in :data:`OUTCOMES` order, its seconds their sum, its
    detail that of the first test with that outcome.
    """
    tests: dict[str, list[Mapping]] = {}
    for r in records:
        tests.setdefault(r["nodeid"], []).append(r)
    checks: dict[str, dict] = {}
    for nodeid, phases in tests.items():
        outcome, detail = _test_outcome(phases)
        seconds = sum(p["seconds"] for p in phases)
        row = checks.setdefault(check_name(nodeid), {"outcome": None, "seconds": 0.0,
                                                     "detail": ""})  # fmt: skip
        row["seconds"] += seconds
        if row["outcome"] is None or OUTCOMES.index(outcome) < OUTCOMES.index(row["outcome"]):
            row["outcome"], row["detail"] = outcome, detail
    return [{"check": name, **row, "seconds": round(row["seconds"], 3)}
            for name, row in checks.items()]  # fmt: skip


def read_records(path: pathlib.Path) -> list[dict]:
    """The JSON lines the plugin wrote; a line cut short by a kill is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def totals(checks: Sequence[Mapping]) -> dict[str, int]:
    """Checks per outcome, every outcome of :data:`OUTCOMES` present."""
    return {o: sum(c["outcome"] == o for c in checks) for o in OUTCOMES}


# pytest's exit codes that say nothing beyond the tests' own reports: all passed,
# some failed, none collected (https://docs.pytest.org/en/stable/reference/exit-codes.html).
_PYTEST_OK_CODES = (0, 1, 5)


def broken_passes(passes: Sequence[Mapping]) -> list[Mapping]:
    """Passes that ended otherwise than pytest does after running its tests: interrupted,
    an internal or usage error, killed at the time limit (-9)."""
    return [p for p in passes
            if p["returncode"] is not None and p["returncode"] not in _PYTEST_OK_CODES]  # fmt: skip


def exit_status(checks: Sequence[Mapping], passes: Sequence[Mapping] = ()) -> int:
    """0, 1 or 3 (see the module docstring) from the checks' outcomes and the passes'
    exit codes: a broken pass (see :func:`broken_passes`) fails the run, a pass never
    started (``returncode`` None) leaves checks out like a ``not started`` check."""
    count = totals(checks)
    if count["failed"] or count["error"] or count["unfinished"] or broken_passes(passes):
        return EXIT_FAILED
    left_out = count["not started"] or any(p["returncode"] is None for p in passes)
    return EXIT_NOT_STARTED if left_out else EXIT_OK


def format_table(checks: Sequence[Mapping], wall_s: float | None = None) -> str:
    """The summary table: ``check  outcome  seconds  detail``, one line a check, failures
    in capitals, then a totals line (``3 passed, 1 failed, ... in 312 s``)."""
    width = max([len("check"), *(len(c["check"]) for c in checks)])
    lines = [f"{'check':<{width}}  {'outcome':<11}  {'seconds':>7}  detail"]
    for c in checks:
        shown = c["outcome"].upper() if c["outcome"] in OUTCOMES[:3] else c["outcome"]
        lines.append(f"{c['check']:<{width}}  {shown:<11}  {c['seconds']:7.1f}  "
                     f"{c['detail'][:120]}".rstrip())  # fmt: skip
    count = totals(checks)
    line = ", ".join(f"{n} {o}" for o, n in count.items() if n) or "no checks ran"
    lines.append(line + (f" in {wall_s:.0f} s" if wall_s is not None else ""))
    return "\n".join(lines)


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
    utc: str | None = None,
) -> pathlib.Path:
    """Write ``folder/gpu_check.json`` in the shape of the module docstring; its path."""
    summary = {
        "command": command,
        "utc": utc or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "wall_s": round(wall_s, 1),
        "machine": dict(machine),
        "passes": list(passes),
        "checks": list(checks),
        "totals": totals(checks),
        "results": sorted(results),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SUMMARY_NAME
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def keep_results(source: pathlib.Path, folder: pathlib.Path) -> list[str]:
    """Copy the ``*.json`` files the GPU tests wrote in ``source`` into ``folder`` after
    removing those the previous summary there listed (so no stale result is left
    beside a new summary); the names copied."""
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
            shutil.copyfile(path, folder / path.name)
            names.append(path.name)
    return names


# ---------------------------------------------------------------- running


def check_passes(notebooks: bool = True) -> list[tuple[str, list[str]]]:
    """``(what, pytest arguments)`` of each pass, run from the repository root (the
    plugin's options come on top, see :func:`plugin_args`)."""
    # One notebook that cannot be collected must not stop the others.
    go_on = "--continue-on-collection-errors"
    passes = [("GPU tests", [go_on, "tests/gpu/test_gpu.py"])]
    if notebooks:
        # tests/gpu/test_gpu.py is named only so that pytest loads tests/conftest.py, which
        # marks the notebooks serial; --deselect keeps its tests out of these passes.
        nb = ["tests/gpu/test_gpu.py", "notebooks", "--deselect", "tests/gpu/test_gpu.py"]
        passes += [
            ("notebooks beside others", [go_on, "-n", "2", "--dist", "loadfile",
                                         "-m", "not serial", *nb]),
            ("notebooks one at a time", [go_on, "-m", "serial", *nb]),
        ]  # fmt: skip
    return passes


def plugin_args(reports: pathlib.Path, deadline: float) -> list[str]:
    """pytest options that load this module as a plugin, writing to ``reports`` and
    starting no check after ``deadline`` (``time.time()``)."""
    return ["-p", "ddp_course.harness.gpu_check", f"--gpu-check-reports={reports}",
            f"--gpu-check-deadline={deadline:.3f}"]  # fmt: skip


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
    killed with everything it started after ``timeout_s`` seconds (returns -9 then)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=dict(env),
                            start_new_session=True)  # fmt: skip
    try:
        return proc.wait(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        print(f"gpu-check: the pass ran past the time limit; stopping it ({timeout_s:.0f} s)",
              flush=True)  # fmt: skip
        _kill_tree(proc)
        return -9
    finally:
        if proc.poll() is None:
            _kill_tree(proc)


def gpu_check(
    budget_s: float = BUDGET_S,
    out: pathlib.Path | None = None,
    notebooks: bool = True,
    runner: Runner = run_pytest,
    command: str = "python -m ddp_course gpu-check",
) -> int:
    """Run the checks, write the summary and print the table; the exit status.

    Args:
        budget_s: seconds after which no new check starts; every pass is killed
            :data:`GRACE_S` seconds later.
        out: the results folder; default ``benchmarks/<folder_name(GPUs)>``.
        notebooks: also run every notebook (passes 2 and 3).
        runner: runs one pass (``run_pytest``; tests pass a fake).
        command: the command line recorded in the summary.

    Returns:
        :data:`EXIT_NO_GPU` without a GPU (one line printed, nothing run), else
        :func:`exit_status` of the checks.
    """
    from .. import runtime

    if runtime.gpu_count() == 0:
        print(no_gpu_message(), flush=True)
        return EXIT_NO_GPU
    start = time.time()
    deadline, hard = start + budget_s, start + budget_s + GRACE_S
    machine = machine_info()
    folder = out if out is not None else ROOT / "benchmarks" / folder_name(
        [g["name"] for g in machine["gpus"]]
    )  # fmt: skip
    names = ", ".join(g["name"] for g in machine["gpus"])
    print(f"gpu-check: {machine['gpu_count']} GPU(s) ({names}); torch {machine['torch']}, "
          f"CUDA {machine['cuda']}; no new check after {budget_s:.0f} s; summary in "
          f"{_shown(folder)}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ddp_course_gpu_check_") as tmp:
        reports, results = pathlib.Path(tmp, "reports.jsonl"), pathlib.Path(tmp, "results")
        results.mkdir()
        # The launcher's device plan decides, not a DDP_COURSE_DEVICE left in the shell.
        env = {k: v for k, v in os.environ.items() if k != runtime.DEVICE_ENV}
        env[RESULTS_ENV] = str(results)
        passes = []
        for what, args in check_passes(notebooks):
            shown = shlex.join(["python", "-m", "pytest", *args])
            left = hard - time.time()
            if left <= 0:  # its checks would all be "not started"; say so in the passes
                passes.append({"what": what, "command": shown, "returncode": None,
                               "seconds": 0.0})  # fmt: skip
                continue
            print(f"\ngpu-check: {what}: {shown}", flush=True)
            t0 = time.time()
            code = runner([*plugin_args(reports, deadline), *args], env, left)
            passes.append({"what": what, "command": shown, "returncode": code,
                           "seconds": round(time.time() - t0, 1)})  # fmt: skip
        checks = collect_checks(read_records(reports))
        kept = keep_results(results, folder)
    wall_s = time.time() - start
    path = write_summary(folder, command=command, budget_s=budget_s, wall_s=wall_s,
                         machine=machine, passes=passes, checks=checks, results=kept)  # fmt: skip
    print("\n" + format_table(checks, wall_s))
    print(f"summary: {_shown(path)}" + (f" with {len(kept)} result file(s)" if kept else ""))
    for p in broken_passes(passes):
        print(f"the pass '{p['what']}' ended with pytest's exit code {p['returncode']}: "
              "see its output above; checks it had not begun are not listed")  # fmt: skip
    for p in passes:
        if p["returncode"] is None:
            print(f"the pass '{p['what']}' was not started: the time limit was reached")
    status = exit_status(checks, passes)
    if status == EXIT_NOT_STARTED:
        print(f"{totals(checks)['not started']} check(s) not started: the budget of "
              f"{budget_s:.0f} s was spent (--budget-s gives more)")  # fmt: skip
    return status


def _shown(path: pathlib.Path) -> str:
    try:
        return str(path.resolve().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)
