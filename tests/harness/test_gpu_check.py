"""``python -m ddp_course gpu-check`` on a machine without a GPU: the one-line refusal, the
plan and its dry run, the order, budget and exit codes of a run (a fake pytest and a fake
clock, the GPU count patched), and everything it does with outcomes (the pytest plugin, skip
lines, the collector, the summary JSON, the table, the results folder), driven by fake
passes and by small real pytest runs."""

import datetime
import json
import subprocess
import sys
import textwrap
import time

import pytest

from ddp_course import runtime
from ddp_course.harness import gpu_check, gpu_plan, gpu_reports, gpu_summary
from ddp_course.harness.cli import main
from ddp_course.harness.gpu_check import RESULTS_ENV
from ddp_course.harness.gpu_reports import NOT_STARTED


def test_without_a_gpu_it_says_so_in_one_line_and_runs_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(runtime, "gpu_count", lambda: 0)

    def must_not_run(*args, **kwargs):
        raise AssertionError("gpu-check started something on a machine without a GPU")

    monkeypatch.setattr(gpu_check.subprocess, "Popen", must_not_run)
    monkeypatch.setattr(gpu_check, "machine_info", must_not_run)
    out = tmp_path / "out"
    assert main(["gpu-check", "--out", str(out)]) == gpu_summary.EXIT_NO_GPU != 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU is visible here")
    assert "nothing was run" in lines[0]
    assert not out.exists()


@pytest.mark.skipif(runtime.gpu_count() > 0, reason="this machine has a GPU")
def test_make_gpu_check_exits_non_zero_here(root):
    done = subprocess.run(
        [sys.executable, "-m", "ddp_course", "gpu-check"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done
    assert done.stdout.count("\n") == 1 and "no CUDA GPU" in done.stdout
    recipe = (root / "Makefile").read_text().split("\ngpu-check:")[1]
    assert "-m ddp_course gpu-check" in recipe.splitlines()[1]


def test_machine_info_names_the_versions_and_gpus():
    import torch

    info = gpu_check.machine_info()  # read by a child process
    assert info["torch"] == torch.__version__ and info["cuda"] == torch.version.cuda
    assert info["gpu_count"] == runtime.gpu_count() == len(info["gpus"])
    assert set(info) == {
        "python",
        "torch",
        "cuda",
        "cudnn",
        "nccl",
        "cpu_count",
        "gpu_count",
        "gpus",
    }


@pytest.mark.parametrize(
    "names, folder",
    [
        (["NVIDIA H100 80GB HBM3"], "gpu-nvidia-h100-80gb-hbm3"),
        (["Tesla V100-SXM2-16GB"] * 8, "gpu-tesla-v100-sxm2-16gb-x8"),
        (["  NVIDIA GeForce RTX 4090 (laptop) "], "gpu-nvidia-geforce-rtx-4090-laptop"),
        (["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"], "gpu-nvidia-a100-sxm4-40gb-x2"),
        (["***"], "gpu-unknown"),
    ],
)
def test_the_results_folder_is_named_after_the_gpus(names, folder):
    assert gpu_summary.folder_name(names) == folder


def test_a_machine_without_gpus_has_no_folder_name():
    with pytest.raises(ValueError, match="no GPU names"):
        gpu_summary.folder_name([])


def rec(nodeid, when, outcome, seconds=1.0, detail="", skip_lines=()):
    return {
        "nodeid": nodeid,
        "when": when,
        "outcome": outcome,
        "seconds": seconds,
        "detail": detail,
        "skip_lines": list(skip_lines),
    }


def passed(nodeid, seconds=1.0, skip_lines=()):
    return [
        rec(nodeid, "setup", "passed", seconds),
        rec(nodeid, "call", "passed", seconds, skip_lines=skip_lines),
        rec(nodeid, "teardown", "passed", seconds),
    ]


T = "tests/gpu/test_gpu.py::"
NB = "notebooks/05_ddp.ipynb::Cell "
RECORDS = [
    *passed(T + "test_ok", 2.0),
    rec(T + "test_broken", "setup", "passed"),
    rec(T + "test_broken", "call", "failed", 3.0, "AssertionError: 1 != 2"),
    rec(T + "test_broken", "teardown", "passed"),
    rec(T + "test_bad_fixture", "setup", "failed", 0.5, "RuntimeError: no port"),
    rec(T + "test_bad_fixture", "teardown", "passed", 0.0),
    rec(T + "test_two_gpus", "setup", "skipped", 0.0, "needs 2 or more CUDA GPUs; 1 visible"),
    rec(T + "test_two_gpus", "teardown", "passed", 0.0),
    *passed(NB + "0"),
    rec(NB + "1", "setup", "passed"),
    rec(NB + "1", "call", "failed", 4.0, "AssertionError: accuracy 0.1"),
    rec(NB + "1", "teardown", "passed"),
    *passed(NB + "2"),
    rec("notebooks/12_debugging.ipynb::Cell 0", "setup", "skipped", 0.0, NOT_STARTED),
    rec("notebooks/12_debugging.ipynb::Cell 1", "setup", "skipped", 0.0, NOT_STARTED),
    *passed("notebooks/11_multinode.ipynb::Cell 0"),
    rec("notebooks/11_multinode.ipynb::Cell 1", "setup", "passed"),  # killed in its call
    rec("notebooks/13_bad.ipynb", "collect", "failed", 0.0, "ValueError: not a notebook"),
    *passed("notebooks/10_benchmarking.ipynb::Cell 0", skip_lines=["SKIPPED: needs 2 GPUs"]),
    *passed("notebooks/10_benchmarking.ipynb::Cell 1"),
    *passed("notebooks/10_benchmarking.ipynb::Cell 2", skip_lines=["skipped: no nccl", "x"]),
]
EXPECTED = [
    {"check": T + "test_ok", "outcome": "passed", "seconds": 6.0, "skips": 0, "detail": ""},
    {
        "check": T + "test_broken",
        "outcome": "failed",
        "seconds": 5.0,
        "skips": 0,
        "detail": "AssertionError: 1 != 2",
    },
    {
        "check": T + "test_bad_fixture",
        "outcome": "error",
        "seconds": 0.5,
        "skips": 0,
        "detail": "RuntimeError: no port",
    },
    {
        "check": T + "test_two_gpus",
        "outcome": "skipped",
        "seconds": 0.0,
        "skips": 0,
        "detail": "needs 2 or more CUDA GPUs; 1 visible",
    },
    {
        "check": "notebooks/05_ddp.ipynb",
        "outcome": "failed",
        "seconds": 12.0,
        "skips": 0,
        "detail": "AssertionError: accuracy 0.1",
    },
    {
        "check": "notebooks/12_debugging.ipynb",
        "outcome": "not started",
        "seconds": 0.0,
        "skips": 0,
        "detail": NOT_STARTED,
    },
    {
        "check": "notebooks/11_multinode.ipynb",
        "outcome": "not finished",
        "seconds": 4.0,
        "skips": 0,
        "detail": gpu_reports.NOT_FINISHED,
    },
    {
        "check": "notebooks/13_bad.ipynb",
        "outcome": "error",
        "seconds": 0.0,
        "skips": 0,
        "detail": "ValueError: not a notebook",
    },
    {
        "check": "notebooks/10_benchmarking.ipynb",
        "outcome": "skipped",
        "seconds": 9.0,
        "skips": 3,
        "detail": "ran; 3 parts skipped: SKIPPED: needs 2 GPUs",
    },
]


def test_reports_become_one_row_per_test_and_per_notebook():
    assert gpu_reports.collect_checks(RECORDS) == EXPECTED
    assert gpu_reports.totals(EXPECTED) == {
        "failed": 2,
        "error": 2,
        "not finished": 1,
        "passed": 1,
        "skipped": 2,
        "not started": 1,
    }


def test_a_notebook_that_printed_skip_lines_is_skipped_not_passed():
    rows = gpu_reports.collect_checks(passed("notebooks/05_ddp.ipynb::Cell 3", skip_lines=["a"]))
    assert [(r["outcome"], r["skips"]) for r in rows] == [("skipped", 1)]
    assert rows[0]["detail"] == "ran; 1 part skipped: a"
    rows = gpu_reports.collect_checks(passed("notebooks/05_ddp.ipynb::Cell 3"))
    assert [(r["outcome"], r["skips"]) for r in rows] == [("passed", 0)]


def test_skip_lines_are_read_from_a_cells_outputs():
    outputs = [
        {
            "output_type": "stream",
            "name": "stdout",
            "text": "GPUs: 1\nSKIPPED: needs 2 GPUs, this machine has 1.\n  skipped: nccl\n",
        },
        {"output_type": "execute_result", "data": {"text/plain": "'skipped: a value'"}},
        {"output_type": "stream", "name": "stdout", "text": ["not skipped: here\n"]},
        {"output_type": "display_data", "data": {"image/png": "..."}},
    ]
    assert gpu_reports.skip_lines(outputs) == [
        "SKIPPED: needs 2 GPUs, this machine has 1.",
        "skipped: nccl",
    ]
    assert gpu_reports.skip_lines(None) == []


def test_the_plugin_attaches_a_cells_skip_lines_to_its_call_report():
    class Item:  # what nbval's cell item keeps of what the cell printed
        test_outputs = [{"output_type": "stream", "text": "SKIPPED: needs 4 GPUs\n"}]

    class Call:
        when = "call"

    class Report:
        user_properties: list = []

    class Outcome:
        def get_result(self):
            return Report

    plugin = gpu_reports.ReportPlugin(None, None)
    hook = plugin.pytest_runtest_makereport(Item(), Call())
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(Outcome())
    assert Report.user_properties == [("skip_lines", ["SKIPPED: needs 4 GPUs"])]


@pytest.mark.parametrize(
    "rows, passes, status",
    [
        ([("A", "passed"), ("B", "skipped")], [("A", 0)], 0),
        ([("A", "passed"), ("B", "not started")], [("A", 0)], 3),
        ([("A", "passed"), ("B", "not finished")], [("B", gpu_summary.KILLED)], 3),
        ([("A", "passed"), ("B", "failed"), ("B", "not started")], [("B", 1)], 1),
        ([("A", "error"), ("B", "not finished")], [("A", 1)], 1),
        ([("A", "passed")], [("A", 0), ("A", 5)], 0),  # a pass that selects nothing
        ([("A", "passed")], [("A", 0), ("B", 3)], 1),  # pytest's internal error
        ([("A", "passed")], [("A", gpu_summary.KILLED)], 3),  # stopped, nothing failed
        ([("A", "passed"), ("C", "failed"), ("C", "not started")], [("C", 1)], 0),  # C: never
        ([("A", "passed"), ("C", "skipped")], [("A", 0)], 0),
    ],
)
def test_exit_status(rows, passes, status):
    checks = [{"part": p, "check": str(i), "outcome": o} for i, (p, o) in enumerate(rows)]
    runs = [{"part": p, "what": str(i), "returncode": c} for i, (p, c) in enumerate(passes)]
    assert gpu_summary.exit_status(checks, runs) == status


def test_summary_json_and_table(tmp_path):
    machine = {
        "torch": "2.13.0+cu130",
        "cuda": "13.0",
        "gpu_count": 1,
        "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_GiB": 79.2, "capability": "9.0"}],
    }
    passes = [
        {
            "part": "A",
            "what": "tests/gpu/test_gpu.py",
            "returncode": 1,
            "seconds": 30.0,
            "command": "python -m pytest tests/gpu/test_gpu.py",
        }
    ]
    checks = [{"part": "A" if c["check"].startswith("tests") else "B", **c} for c in EXPECTED]
    ws1 = {
        "part": "A",
        "check": T + "test_busbw",
        "outcome": "skipped",
        "seconds": 0.0,
        "skips": 0,
        "detail": f"{gpu_plan.WORLD_SIZE_1}: busbw is 0 by definition",
    }
    checks.append(ws1)
    path = gpu_summary.write_summary(
        tmp_path / "gpu-x",
        command="python -m ddp_course gpu-check --budget-s 540",
        budget_s=540,
        wall_s=61.26,
        machine=machine,
        passes=passes,
        checks=checks,
        results=["b.json", "a.json"],
        utc="2026-11-23T09:00:00+00:00",
    )
    assert path == tmp_path / "gpu-x" / "gpu_check.json"
    summary = json.loads(path.read_text())
    assert summary == {
        "command": "python -m ddp_course gpu-check --budget-s 540",
        "utc": "2026-11-23T09:00:00+00:00",
        "budget_s": 540,
        "wall_s": 61.3,
        "gpus": 1,
        "machine": machine,
        "plan": [],
        "passes": passes,
        "checks": checks,
        "totals": gpu_reports.totals_by_part(checks),
        "results": ["a.json", "b.json"],
        "world_size_1": {"paths": list(gpu_plan.WORLD_SIZE_1_PATHS), "tests": [ws1["check"]]},
    }
    assert summary["totals"]["B"]["not finished"] == 1 and summary["totals"]["C"]["passed"] == 0
    table = gpu_summary.format_table(checks, 61.26).splitlines()
    width = max(len(c["check"]) for c in checks) + 2  # the longest name, two spaces
    assert table[0].split() == ["part", "check", "outcome", "seconds", "detail"]
    assert table[1] == f"A     {T + 'test_ok':<{width}}passed            6.0"
    assert table[2].startswith(f"A     {T + 'test_broken':<{width}}FAILED            5.0  Ass")
    assert table[7].split()[1:4] == ["notebooks/11_multinode.ipynb", "NOT", "FINISHED"]
    assert table[-3:] == [
        "A: 1 failed, 1 error, 1 passed, 2 skipped",
        "B: 1 failed, 1 error, 1 not finished, 1 skipped, 1 not started",
        "in 61 s",
    ]
    machine2 = {**machine, "gpu_count": 2}
    path = gpu_summary.write_summary(
        tmp_path / "gpu-y",
        command="c",
        budget_s=1,
        wall_s=1,
        machine=machine2,
        passes=[],
        checks=checks,
        results=[],
    )
    assert json.loads(path.read_text())["world_size_1"] is None


def test_world_size_1_records_say_so_in_their_names(tmp_path):
    source, folder = tmp_path / "source", tmp_path / "gpu-nvidia-h100"
    source.mkdir()
    (source / "00_hello_ranks.json").write_text('{"world_size": 1, "backend": "nccl"}')
    (source / "10_benchmark.json").write_text('{"meta": {"world_size": 1}, "rows": []}')
    (source / "09_fsdp.json").write_text('{"world_size": 2}')
    (source / "odd.json").write_text("[1, 2]")
    kept = gpu_summary.keep_results(source, folder)
    assert kept == [
        "00_hello_ranks-world-size-1.json",
        "09_fsdp.json",
        "10_benchmark-world-size-1.json",
        "odd.json",
    ]
    assert sorted(p.name for p in folder.iterdir()) == sorted(kept)


def test_the_plugin_skips_what_would_start_after_the_deadline():
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    def must_run(plugin, nodeid):
        # A skip raised here would skip this test instead of failing it.
        try:
            plugin.pytest_runtest_setup(Item(nodeid))
        except pytest.skip.Exception as exc:
            pytest.fail(f"{nodeid} was not started: {exc}")

    late = gpu_reports.ReportPlugin(None, deadline=time.time() - 1)
    late.started.add("notebooks/05_ddp.ipynb")  # began before the deadline
    must_run(late, "notebooks/05_ddp.ipynb::Cell 7")  # runs to its end
    for nodeid in ("notebooks/06_samplers.ipynb::Cell 0", "tests/gpu/test_gpu.py::test_x"):
        with pytest.raises(pytest.skip.Exception, match=NOT_STARTED):
            late.pytest_runtest_setup(Item(nodeid))
    early = gpu_reports.ReportPlugin(None, deadline=time.time() + 600)
    must_run(early, "tests/gpu/test_gpu.py::test_x")
    assert early.started == {"tests/gpu/test_gpu.py::test_x"}


SAMPLE_TESTS = textwrap.dedent(
    """
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("no port")

    def test_ok():
        pass

    def test_broken():
        assert 1 == 2, "one is not two"

    def test_bad_fixture(broken):
        pass

    def test_two_gpus():
        pytest.skip("needs 2 or more CUDA GPUs; 1 visible")
    """
)


def _pytest_with_the_plugin(folder, deadline, *options):
    """Run pytest on SAMPLE_TESTS in ``folder`` with the plugin; the checks it recorded."""
    (folder / "test_sample.py").write_text(SAMPLE_TESTS)
    (folder / "test_syntax.py").write_text("def test_(:\n")
    reports = folder / "reports.jsonl"
    args = [
        *gpu_reports.plugin_args(reports, deadline),
        *options,
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
    ]
    subprocess.run(
        [sys.executable, "-m", "pytest", *args], cwd=folder, capture_output=True, timeout=300
    )
    records = gpu_reports.read_records(reports)
    return {c["check"]: c for c in gpu_reports.collect_checks(records)}, records


def test_the_plugin_records_pytests_reports_under_xdist(tmp_path):
    checks, records = _pytest_with_the_plugin(tmp_path, time.time() + 600, "-n", "2")
    # Only the controller writes: one set of phases per test, not one per worker too.
    assert len([r for r in records if r["when"] == "setup"]) == 4
    assert {name: c["outcome"] for name, c in checks.items()} == {
        "test_syntax.py": "error",
        "test_sample.py::test_ok": "passed",
        "test_sample.py::test_broken": "failed",
        "test_sample.py::test_bad_fixture": "error",
        "test_sample.py::test_two_gpus": "skipped",
    }
    assert checks["test_sample.py::test_broken"]["detail"].startswith("AssertionError: one is")
    assert checks["test_sample.py::test_bad_fixture"]["detail"] == "RuntimeError: no port"
    assert checks["test_sample.py::test_two_gpus"]["detail"].startswith("needs 2 or more")
    assert "SyntaxError" in checks["test_syntax.py"]["detail"]


def test_no_check_starts_after_the_deadline(tmp_path):
    checks, _ = _pytest_with_the_plugin(tmp_path, time.time() - 1)
    assert checks.pop("test_syntax.py")["outcome"] == "error"
    assert [c["outcome"] for c in checks.values()] == ["not started"] * 4
    assert {c["detail"] for c in checks.values()} == {NOT_STARTED}


# ---------------------------------------------------------------- the plan


def write_notebook(path, seconds, source):
    """A notebook of one code cell whose recorded execution took ``seconds``."""
    start = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.UTC)
    end = start + datetime.timedelta(seconds=seconds)
    cell = {
        "cell_type": "code",
        "source": source,
        "outputs": [],
        "execution_count": 1,
        "metadata": {
            "execution": {
                "iopub.execute_input": start.isoformat().replace("+00:00", "Z"),
                "shell.execute_reply": end.isoformat().replace("+00:00", "Z"),
            }
        },
    }
    path.write_text(
        json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    )


GPU_TESTS = textwrap.dedent(
    """
    import pytest
    from gpu_support import needs_2_gpus, needs_4_gpus, needs_gpu

    @needs_gpu
    def test_one():
        pass

    @needs_2_gpus
    @pytest.mark.parametrize("x", [1, 2, 3])
    def test_three_cases(x):
        pass

    @needs_4_gpus
    def test_four():
        pass

    @needs_gpu
    @world_size_1("busbw")
    def test_between_gpus():
        pass

    def helper():
        pass
    """
)


@pytest.fixture
def course(tmp_path):
    """A small course: two GPU test files and notebooks with and without a CUDA path."""
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_gpu.py").write_text(GPU_TESTS)
    (tmp_path / "tests" / "gpu" / "test_gpu_two.py").write_text(
        "import pytest\nfrom gpu_support import needs_2_gpus\npytestmark = [pytest.mark.serial, "
        "needs_2_gpus]\n\ndef test_a():\n    pass\n"
    )
    (tmp_path / "tests" / "gpu" / "_helper.py").write_text("def test_not_collected(): pass\n")
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    write_notebook(nbs / "00_plain.ipynb", 40, "launch.python('x.py')")
    write_notebook(nbs / "01_cuda.ipynb", 8, "if torch.cuda.is_available():\n    x.cuda()")
    write_notebook(nbs / "02_two_ranks.ipynb", 100, "launch.torchrun('x.py', nproc=2)")
    write_notebook(nbs / "03_nodes.ipynb", 4, "multinode.torchrun_nodes('x.py')")
    write_notebook(nbs / "04_cpu.ipynb", 2, "launch.torchrun('x.py', nproc=2, gpus=0)")
    return tmp_path


def test_gpu_tests_are_counted_from_their_source_with_their_gpu_marks(course):
    files = course / "tests" / "gpu"
    assert [gpu_plan.count_gpu_tests(files / "test_gpu.py", n) for n in (1, 2, 4)] == [
        (1, 6),
        (5, 6),
        (6, 6),
    ]
    assert [gpu_plan.count_gpu_tests(files / "test_gpu_two.py", n) for n in (1, 2)] == [
        (0, 1),
        (1, 1),
    ]


def test_recorded_time_is_the_sum_of_the_cells_execution_stamps(course):
    assert gpu_plan.recorded_seconds(course / "notebooks" / "02_two_ranks.ipynb") == 100
    nb = course / "notebooks" / "05_unrun.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "metadata": {}, "source": ""}]}))
    assert gpu_plan.recorded_seconds(nb) == 0


def test_the_plan_orders_a_then_b_cheapest_first_then_c(course):
    plan = gpu_plan.make_plan(1, 1000, root=course)
    a, b, c = plan.part("A"), plan.part("B"), plan.part("C")
    start, test_s = gpu_plan.PYTEST_START_S, gpu_plan.GPU_TEST_S
    assert [(s.check, s.estimate_s) for s in a] == [
        ("tests/gpu/test_gpu.py", start + test_s),
        ("tests/gpu/test_gpu_two.py", start),
    ]
    # A CUDA path with one GPU: a plain run and torch.cuda in the kernel; cheapest first.
    assert [s.check for s in b] == ["notebooks/01_cuda.ipynb", "notebooks/00_plain.ipynb"]
    assert b[1].estimate_s == 40 * gpu_plan.MARGIN + gpu_plan.NOTEBOOK_START_S
    assert [s.check for s in c] == [
        "notebooks/04_cpu.ipynb",
        "notebooks/03_nodes.ipynb",
        "notebooks/02_two_ranks.ipynb",
    ]
    assert [s.part for s in plan.steps] == ["A", "A", "B", "B", "C", "C", "C"]
    # Two GPUs give the 2-rank notebook a CUDA path; simulated nodes and gpus=0 never.
    two = gpu_plan.make_plan(2, 1000, root=course)
    assert [s.check for s in two.part("B")][-1] == "notebooks/02_two_ranks.ipynb"
    assert {s.check for s in two.part("C")} == {
        "notebooks/04_cpu.ipynb",
        "notebooks/03_nodes.ipynb",
    }


def test_what_does_not_fit_the_budget_is_planned_not_started(course):
    a_s = 2 * gpu_plan.PYTEST_START_S + gpu_plan.GPU_TEST_S
    cuda_s = 8 * gpu_plan.MARGIN + gpu_plan.NOTEBOOK_START_S
    plan = gpu_plan.make_plan(1, a_s + cuda_s + 13, root=course)  # 04_cpu (12.5 s) fits
    assert [s.fits for s in plan.steps] == [True, True, True, False, True, False, False]
    assert plan.estimate_s() == pytest.approx(a_s + cuda_s + plan.steps[4].estimate_s)
    text = gpu_plan.format_plan(plan)
    assert "does not fit: not started (exit 3)" in text
    assert f"--budget-s {plan.needed_s() + 30:.0f} starts them all" in text
    # --all: part C is part of the run, and its default budget fits every check.
    everything = gpu_plan.make_plan(1, root=course, run_all=True)
    assert all(s.fits for s in everything.steps)
    assert everything.budget_s >= sum(s.estimate_s for s in everything.steps)


def test_the_default_budget_is_ten_minutes_with_a_grace_and_larger_with_4_gpus(course):
    assert gpu_plan.default_budget(1) + gpu_plan.GRACE_S <= 600
    assert gpu_plan.default_budget(2) == gpu_plan.default_budget(1)
    assert gpu_plan.default_budget(4) > gpu_plan.default_budget(1)
    four = gpu_plan.format_plan(gpu_plan.make_plan(4, root=course))
    assert f"budget {gpu_plan.BUDGET_S_4_GPUS:.0f} s" in four
    assert f"the default budget is {gpu_plan.BUDGET_S_4_GPUS:.0f} s, not" in four


def test_one_gpu_plans_say_what_world_size_1_cannot_show(course):
    one = gpu_plan.format_plan(gpu_plan.make_plan(1, root=course))
    two = gpu_plan.format_plan(gpu_plan.make_plan(2, root=course))
    assert "world size 1" in one and "world size 1" not in two
    assert all(p in one for p in gpu_plan.WORLD_SIZE_1_PATHS)
    assert "busbw" in one and "local copy" in one


def test_the_courses_own_plan_on_one_h100_fits_ten_minutes():
    plan = gpu_plan.make_plan(1)
    assert plan.estimate_s() <= plan.budget_s <= 600 - gpu_plan.GRACE_S
    a = plan.part("A")
    assert a and all(s.fits for s in a)  # every GPU test file starts on one GPU
    assert {s.check for s in a} == {
        f"tests/gpu/{p.name}" for p in (gpu_plan.ROOT / "tests" / "gpu").glob("test_*.py")
    }
    four = gpu_plan.make_plan(4)
    assert len(four.part("B")) > len(plan.part("B")) and four.budget_s > plan.budget_s


def test_dry_run_prints_the_plans_for_1_2_and_4_gpus_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(runtime, "gpu_count", lambda: 0)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a dry run started something")

    monkeypatch.setattr(gpu_check.subprocess, "Popen", must_not_run)
    monkeypatch.setattr(gpu_check, "machine_info", must_not_run)
    assert main(["gpu-check", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for n in (1, 2, 4):
        assert f"gpu-check plan with {n} GPU(s)" in out
    assert out.count("\nA  GPU tests") == 3 and out.count("\nB  notebooks with a CUDA") == 3
    assert "dry run: nothing was run" in out and "no CUDA GPU" not in out
    assert main(["gpu-check", "--dry-run", "--gpus", "2", "--budget-s", "100"]) == 0
    out = capsys.readouterr().out
    assert "gpu-check plan with 2 GPU(s): budget 100 s" in out
    assert "with 1 GPU(s)" not in out and "with 4 GPU(s)" not in out


def test_make_has_a_spelling_for_the_dry_run(root):
    recipe = (root / "Makefile").read_text().split("\ngpu-check-plan:")[1]
    assert "-m ddp_course gpu-check --dry-run $(ARGS)" in recipe.splitlines()[1]
    # Under `make test` the outer make's flags reach this one and would add its
    # "Entering directory" lines.
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check-plan", "ARGS=--gpus 2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip().endswith("-m ddp_course gpu-check --dry-run --gpus 2")


# ---------------------------------------------------------------- the run


class Clock:
    """time.time() for gpu_check that moves only when a fake pass says so."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self):
        return self.now


def plan_of(budget, *steps, run_all=False, gpus=1):
    return gpu_plan.Plan(
        gpus, budget, tuple(gpu_plan.Step(p, c, e, "", True) for p, c, e in steps), run_all
    )


def fake_run(monkeypatch, tmp_path, plan, outcomes, gpus=1):
    """Run gpu_check with ``plan`` and a fake pytest: each step's check takes its estimate
    (or ``outcomes[check]["seconds"]``) and reports ``outcomes[check]`` (records and a
    return code). Returns (status, the checks the runner saw, their args, the summary)."""
    clock = Clock()
    monkeypatch.setattr(gpu_check, "time", clock)
    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    monkeypatch.setattr(gpu_check, "make_plan", lambda *a, **k: plan)
    machine = {
        "torch": "2.13.0+cu130",
        "cuda": "13.0",
        "gpu_count": gpus,
        "gpus": [{"name": "NVIDIA H100 80GB HBM3"}] * gpus,
    }
    monkeypatch.setattr(gpu_check, "machine_info", lambda: machine)
    estimates = {s.check: s.estimate_s for s in plan.steps}
    seen = []

    def fake_pytest(args, env, timeout_s):
        check = args[-1]
        seen.append((check, args, timeout_s))
        records, code, seconds = outcomes.get(check, (None, 0, None))
        if records is None:
            records = (
                passed(f"{check}::Cell 0")
                if check.endswith(".ipynb")
                else passed(f"{check}::test_x")
            )
        reports = next(a.split("=", 1)[1] for a in args if a.startswith("--gpu-check-reports="))
        with open(reports, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        clock.now += estimates[check] if seconds is None else seconds
        return code

    status = gpu_check.gpu_check(out=tmp_path / "out", runner=fake_pytest, command="c")
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    return status, seen, summary


def outcome_of(summary):
    return {c["check"].split("::")[0]: (c["part"], c["outcome"]) for c in summary["checks"]}


def test_a_then_b_one_at_a_time_each_only_if_it_fits_and_c_listed(monkeypatch, tmp_path):
    plan = plan_of(
        300,
        ("A", "tests/gpu/test_gpu.py", 100),
        ("A", "tests/gpu/test_gpu_lesson03.py", 50),
        ("B", "notebooks/02_dp.ipynb", 60),
        ("B", "notebooks/05_ddp.ipynb", 80),
        ("B", "notebooks/06_samplers.ipynb", 120),
        ("C", "notebooks/08_pp.ipynb", 70),
    )
    # The first A file takes longer than estimated: 05 no longer fits the time left.
    outcomes = {"tests/gpu/test_gpu.py": (None, 0, 130)}
    status, seen, summary = fake_run(monkeypatch, tmp_path, plan, outcomes)
    assert [check for check, _, _ in seen] == [
        "tests/gpu/test_gpu.py",
        "tests/gpu/test_gpu_lesson03.py",
        "notebooks/02_dp.ipynb",
    ]
    for _, args, timeout_s in seen:
        assert "-n" not in args and args.count(args[-1]) == 1  # one check a pass, no xdist
        assert 0 < timeout_s <= 300 + gpu_plan.GRACE_S
    assert outcome_of(summary) == {
        "tests/gpu/test_gpu.py": ("A", "passed"),
        "tests/gpu/test_gpu_lesson03.py": ("A", "passed"),
        "notebooks/02_dp.ipynb": ("B", "passed"),
        "notebooks/05_ddp.ipynb": ("B", "not started"),
        "notebooks/06_samplers.ipynb": ("B", "not started"),
        "notebooks/08_pp.ipynb": ("C", "skipped"),
    }
    rows = {c["check"]: c for c in summary["checks"]}
    assert rows["notebooks/05_ddp.ipynb"]["detail"].endswith("needs ~80 s, 60 s left")
    assert rows["notebooks/08_pp.ipynb"]["detail"] == gpu_plan.c_reason(1)
    assert status == gpu_summary.EXIT_NOT_FINISHED == 3


def test_everything_of_a_and_b_passing_is_exit_0_and_c_runs_in_time_left(monkeypatch, tmp_path):
    plan = plan_of(
        300,
        ("A", "tests/gpu/test_gpu.py", 100),
        ("B", "notebooks/02_dp.ipynb", 60),
        ("C", "notebooks/08_pp.ipynb", 50),
        ("C", "notebooks/09_zero.ipynb", 200),
    )
    outcomes = {
        "notebooks/08_pp.ipynb": (
            [rec("notebooks/08_pp.ipynb::Cell 0", "call", "failed", 1.0, "boom")],
            1,
            None,
        )
    }
    status, seen, summary = fake_run(monkeypatch, tmp_path, plan, outcomes)
    assert [check for check, _, _ in seen][-1] == "notebooks/08_pp.ipynb"
    assert outcome_of(summary)["notebooks/08_pp.ipynb"] == ("C", "failed")
    assert outcome_of(summary)["notebooks/09_zero.ipynb"] == ("C", "skipped")
    assert status == gpu_summary.EXIT_OK  # part C never changes it


def test_a_check_cut_off_at_the_limit_is_not_finished_never_failed(monkeypatch, tmp_path):
    plan = plan_of(100, ("A", "tests/gpu/test_gpu.py", 50), ("B", "notebooks/11_mn.ipynb", 40))
    cut = [
        *passed("notebooks/11_mn.ipynb::Cell 0"),
        rec("notebooks/11_mn.ipynb::Cell 1", "setup", "passed"),
    ]
    outcomes = {"notebooks/11_mn.ipynb": (cut, gpu_summary.KILLED, 110)}
    status, _, summary = fake_run(monkeypatch, tmp_path, plan, outcomes)
    assert outcome_of(summary)["notebooks/11_mn.ipynb"] == ("B", "not finished")
    assert status == gpu_summary.EXIT_NOT_FINISHED
    # Killed before its first report (a kernel still starting): a row all the same.
    outcomes = {"notebooks/11_mn.ipynb": ([], gpu_summary.KILLED, 110)}
    status, _, summary = fake_run(monkeypatch, tmp_path, plan, outcomes)
    assert outcome_of(summary)["notebooks/11_mn.ipynb"] == ("B", "not finished")
    assert status == gpu_summary.EXIT_NOT_FINISHED


def test_a_real_failure_is_exit_1_whatever_else_was_left_out(monkeypatch, tmp_path):
    plan = plan_of(100, ("A", "tests/gpu/test_gpu.py", 90), ("B", "notebooks/05.ipynb", 40))
    outcomes = {"tests/gpu/test_gpu.py": (RECORDS[:6], 1, None)}  # test_ok, test_broken
    status, _, summary = fake_run(monkeypatch, tmp_path, plan, outcomes)
    assert outcome_of(summary)["notebooks/05.ipynb"] == ("B", "not started")
    assert status == gpu_summary.EXIT_FAILED
    # A pass that ended without any report (pytest could not start) is an error row.
    outcomes = {"tests/gpu/test_gpu.py": ([], 4, None)}
    status, _, summary = fake_run(monkeypatch, tmp_path, plan, outcomes)
    row = summary["checks"][0]
    assert (row["outcome"], row["detail"]) == ("error", "pytest exit code 4, no report")
    assert status == gpu_summary.EXIT_FAILED


def test_a_notebook_that_skipped_its_gpu_part_is_reported_skipped(monkeypatch, tmp_path):
    plan = plan_of(300, ("A", "tests/gpu/test_gpu.py", 50), ("B", "notebooks/10.ipynb", 40))
    printed = passed("notebooks/10.ipynb::Cell 77", skip_lines=["SKIPPED: needs 2 GPUs"])
    status, _, summary = fake_run(
        monkeypatch, tmp_path, plan, {"notebooks/10.ipynb": (printed, 0, None)}
    )
    row = summary["checks"][-1]
    assert (row["outcome"], row["skips"]) == ("skipped", 1)
    assert row["detail"] == "ran; 1 part skipped: SKIPPED: needs 2 GPUs"
    assert status == gpu_summary.EXIT_OK


def test_gpu_check_prints_the_plan_first_and_keeps_what_the_tests_wrote(
    monkeypatch, tmp_path, capsys
):
    plan = plan_of(300, ("A", "tests/gpu/test_gpu.py", 50), ("B", "notebooks/10.ipynb", 40))
    monkeypatch.setenv(runtime.DEVICE_ENV, "cpu")  # a leftover that would defeat the plan
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.json").write_text("{}")  # a result of the previous run ...
    (out / "notes.json").write_text("{}")  # ... and a file someone put here
    (out / "gpu_check.json").write_text(json.dumps({"results": ["old.json", "../x.json"]}))
    envs = []

    def write_result(args, env, timeout_s):
        envs.append(env)
        if args[-1].startswith("tests/gpu"):
            with open(f"{env[RESULTS_ENV]}/00_hello_ranks.json", "w") as f:
                f.write('{"backend": "nccl", "world_size": 1}')
        return 0

    clock = Clock()
    monkeypatch.setattr(gpu_check, "time", clock)
    monkeypatch.setattr(runtime, "gpu_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "make_plan", lambda *a, **k: plan)
    monkeypatch.setattr(
        gpu_check,
        "machine_info",
        lambda: {
            "torch": "t",
            "cuda": "c",
            "gpu_count": 1,
            "gpus": [{"name": "NVIDIA H100 80GB HBM3"}],
        },
    )
    gpu_check.gpu_check(out=out, runner=write_result, command="c")
    assert all(runtime.DEVICE_ENV not in env and env[RESULTS_ENV] for env in envs)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["results"] == ["00_hello_ranks-world-size-1.json"]
    assert not (out / "old.json").exists() and (out / "notes.json").exists()
    assert [s["check"] for s in summary["plan"]] == [s.check for s in plan.steps]
    printed = capsys.readouterr().out
    assert printed.index("gpu-check plan with 1 GPU(s)") < printed.index("part A: python -m")
    assert "world size 1: one GPU could not exercise" in printed


def test_nbval_reports_carry_the_skip_lines_a_notebook_printed(tmp_path):
    # A real nbval run of a small notebook with the plugin: the skip line a cell printed
    # reaches the notebook's row, which is then skipped, not passed.
    cells = ["print('GPUs: 1')", "print('SKIPPED: needs 2 GPUs, this machine has 1')"]
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "metadata": {},
                "source": c,
                "outputs": [],
                "execution_count": None,
            }
            for c in cells
        ],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "10_x.ipynb").write_text(json.dumps(nb))
    reports = tmp_path / "reports.jsonl"
    args = [
        *gpu_reports.plugin_args(reports, time.time() + 600),
        "--nbval-lax",
        "--nbval-current-env",
        "-p",
        "no:cacheprovider",
        "10_x.ipynb",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    (row,) = gpu_reports.collect_checks(gpu_reports.read_records(reports))
    assert (row["check"], row["outcome"], row["skips"]) == ("10_x.ipynb", "skipped", 1)
    assert row["detail"] == "ran; 1 part skipped: SKIPPED: needs 2 GPUs, this machine has 1"


ONE_GPU = """
import sys
import torch
# A machine with one GPU, as far as the skip marks can tell: nothing here touches CUDA,
# since each test this run selects is skipped before its fixtures are set up.
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_on_one_gpu_the_gpu_tests_name_the_nccl_paths_world_size_1_cannot_show(root, tmp_path):
    source = (root / "tests" / "gpu" / "test_gpu.py").read_text()
    marked = source.count("@world_size_1(")
    assert marked >= 5
    reports = tmp_path / "reports.jsonl"
    args = [
        *gpu_reports.plugin_args(reports, time.time() + 600),
        "-p",
        "no:cacheprovider",
        "tests/gpu/test_gpu.py",
        "-k",
        "several or between or fewer",
    ]
    done = subprocess.run(
        [sys.executable, "-c", ONE_GPU, *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    records = gpu_reports.read_records(reports)
    checks = [{"part": "A", **c} for c in gpu_reports.collect_checks(records)]
    assert len(checks) == marked and {c["outcome"] for c in checks} == {"skipped"}
    for c in checks:
        assert c["detail"].startswith(f"{gpu_plan.WORLD_SIZE_1} (one GPU): "), c
        assert c["detail"].endswith("needs 2 or more GPUs")
    report = gpu_summary.world_size_1_report(1, checks)
    assert report["tests"] == [c["check"] for c in checks]
    assert report["paths"] == list(gpu_plan.WORLD_SIZE_1_PATHS)
    # The plan counts these tests as not run on one GPU.
    run1, total = gpu_plan.count_gpu_tests(root / "tests" / "gpu" / "test_gpu.py", 1)
    run2, _ = gpu_plan.count_gpu_tests(root / "tests" / "gpu" / "test_gpu.py", 2)
    assert run2 - run1 == marked and run2 == total


def test_a_gpu_test_file_starts_past_its_estimate_but_not_past_the_budget(monkeypatch, tmp_path):
    plan = plan_of(
        100,
        ("A", "tests/gpu/test_gpu.py", 50),
        ("A", "tests/gpu/test_gpu_lesson03.py", 60),
        ("A", "tests/gpu/test_gpu_lesson15.py", 10),
    )
    outcomes = {"tests/gpu/test_gpu_lesson03.py": (None, 0, 70)}  # ends at 120 s
    status, seen, summary = fake_run(monkeypatch, tmp_path, plan, outcomes)
    assert [check for check, _, _ in seen] == [
        "tests/gpu/test_gpu.py",
        "tests/gpu/test_gpu_lesson03.py",
    ]
    assert outcome_of(summary)["tests/gpu/test_gpu_lesson15.py"] == ("A", "not started")
    assert status == gpu_summary.EXIT_NOT_FINISHED
