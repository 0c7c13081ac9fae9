"""What ``python -m ddp_course gpu-check`` learns from the pytest passes it starts: a pytest
plugin that appends every test report to a JSON-lines file as it arrives (so a pass
stopped at the time limit keeps its outcomes) and starts no check after a deadline, and
the rules that turn those reports into one row per check (a GPU test, or a notebook's
cells) with its outcome, its seconds and the ``skipped:`` lines a notebook printed.

Load it into a pass with :func:`plugin_args` (``-p ddp_course.harness.gpu_reports``).
Nothing here imports torch: pytest loads this module into every pass.
"""

from __future__ import annotations

import json
import pathlib
import re
import time
from collections.abc import Iterable, Mapping, Sequence

import pytest

from .gpu_plan import PARTS

NOT_STARTED = "not started: the time budget of gpu-check was spent"
NOT_FINISHED = "stopped at gpu-check's time limit"
# Worst first: a check's outcome is the worst of its tests' (a notebook's cells').
OUTCOMES = ("failed", "error", "not finished", "passed", "skipped", "not started")
# A notebook's line that says a part of it did not run (course convention: "skipped: ..."
# or "SKIPPED: ...", at the start of a printed line).
SKIP_LINE = re.compile(r"^\s*(?:skipped|SKIPPED)\b.*$", re.MULTILINE)


def plugin_args(reports: pathlib.Path, deadline: float) -> list[str]:
    """pytest options that load this module as a plugin, writing to ``reports`` and
    starting no check after ``deadline`` (``time.time()``)."""
    return [
        "-p",
        "ddp_course.harness.gpu_reports",
        f"--gpu-check-reports={reports}",
        f"--gpu-check-deadline={deadline:.3f}",
    ]


# ---------------------------------------------------------------- pytest plugin


def pytest_addoption(parser: pytest.Parser) -> None:
    """pytest hook: the plugin's options (where to append reports, the deadline)."""
    group = parser.getgroup("gpu-check", "python -m ddp_course gpu-check")
    group.addoption("--gpu-check-reports", help="append every test report here (JSON lines)")
    group.addoption(
        "--gpu-check-deadline", type=float, help="time.time() after which no new check starts"
    )


def pytest_configure(config: pytest.Config) -> None:
    """pytest hook: register the report writer and the deadline when the options are given."""
    reports = config.getoption("gpu_check_reports")
    deadline = config.getoption("gpu_check_deadline")
    if reports or deadline is not None:
        # Under pytest-xdist the workers run the tests and the controller receives
        # every report: workers apply the deadline, only the controller writes.
        worker = hasattr(config, "workerinput")
        config.pluginmanager.register(
            ReportPlugin(None if worker else reports, deadline), "ddp-course-gpu-check"
        )


def skip_lines(outputs: Iterable[Mapping] | None) -> list[str]:
    """The lines of a cell's outputs (nbformat output dicts: streams, ``text/plain``) that
    start with ``skipped`` or ``SKIPPED`` (:data:`SKIP_LINE`), stripped."""
    found = []
    for out in outputs or ():
        text = out.get("text") or out.get("data", {}).get("text/plain") or ""
        text = "".join(text) if isinstance(text, list) else str(text)
        found += [m.group(0).strip() for m in SKIP_LINE.finditer(text)]
    return found


class ReportPlugin:
    """The plugin :func:`pytest_configure` registers: appends each test report's
    :func:`report_record` to ``reports`` (JSON lines; ``None`` writes nothing, as on an
    xdist worker) and skips, with :data:`NOT_STARTED`, any check that would start after
    ``deadline`` (``time.time()``; ``None``: no deadline)."""

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

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        if call.when == "call":
            # nbval keeps what a cell printed in item.test_outputs (None for other tests).
            lines = skip_lines(getattr(item, "test_outputs", None))
            if lines:
                report.user_properties.append(("skip_lines", lines))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write(report_record(report))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # a notebook or test file that cannot even be collected
            self._write(
                {
                    "nodeid": report.nodeid,
                    "when": "collect",
                    "outcome": "failed",
                    "seconds": 0.0,
                    "detail": _last_line(report.longreprtext),
                }
            )

    def _write(self, record: dict) -> None:
        if self.reports is None:
            return
        with self.reports.open("a") as f:  # one line at a time: a killed pass keeps its lines
            f.write(json.dumps(record) + "\n")


def report_record(report: pytest.TestReport) -> dict:
    """One phase of one test as a JSON-ready dict: ``nodeid``, ``when`` (setup, call,
    teardown), ``outcome`` (passed, failed, skipped), ``seconds``, ``detail`` (the skip
    reason, or the last line of the failure) and ``skip_lines`` (a notebook cell's printed
    skip lines, see :func:`skip_lines`)."""
    detail = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        detail = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        # A Python test's crash line ("AssertionError: ..."); nbval's report of a cell is
        # text that ends with the kernel's traceback, whose last line names the exception.
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else ""
        detail = text.splitlines()[0][:300] if text.strip() else _last_line(report.longreprtext)
    lines = dict(report.user_properties).get("skip_lines", [])
    return {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": report.duration,
        "detail": detail,
        "skip_lines": list(lines),
    }


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
        return "not finished", NOT_FINISHED
    return "passed", ""


def collect_checks(records: Iterable[Mapping]) -> list[dict]:
    """Reports (:func:`report_record` dicts) -> one row per check, in the order they ran.

    A test's outcome comes from its phases (a failure in ``call`` is ``failed``, in set-up
    or tear-down ``error``; set up but never called is ``not finished``); a check's is the
    worst of its tests' in :data:`OUTCOMES` order, its seconds their sum, its detail that of
    the first test with that outcome. ``skips`` counts the skip lines its cells printed; a
    check that passed with skip lines is ``skipped``, its detail the count and the first.
    """
    tests: dict[str, list[Mapping]] = {}
    for r in records:
        tests.setdefault(r["nodeid"], []).append(r)
    checks: dict[str, dict] = {}
    for nodeid, phases in tests.items():
        outcome, detail = _test_outcome(phases)
        row = checks.setdefault(
            check_name(nodeid), {"outcome": None, "seconds": 0.0, "lines": [], "detail": ""}
        )
        row["seconds"] += sum(p["seconds"] for p in phases)
        row["lines"] += [line for p in phases for line in p.get("skip_lines", [])]
        if row["outcome"] is None or OUTCOMES.index(outcome) < OUTCOMES.index(row["outcome"]):
            row["outcome"], row["detail"] = outcome, detail
    rows = []
    for name, row in checks.items():
        lines = row.pop("lines")
        if row["outcome"] == "passed" and lines:
            parts = "part" if len(lines) == 1 else "parts"
            row["outcome"], row["detail"] = (
                "skipped",
                f"ran; {len(lines)} {parts} skipped: {lines[0]}",
            )
        rows.append(
            {"check": name, **row, "seconds": round(row["seconds"], 3), "skips": len(lines)}
        )
    return rows


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


def totals_by_part(checks: Sequence[Mapping]) -> dict[str, dict[str, int]]:
    """:func:`totals` of each part of :data:`~ddp_course.harness.gpu_plan.PARTS`."""
    return {part: totals([c for c in checks if c["part"] == part]) for part in PARTS}
