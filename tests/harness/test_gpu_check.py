"""``python -m ddp_course gpu-check`` on a machine without a GPU: the one-line refusal, and
everything it does with outcomes (the pytest plugin, the collector, the summary JSON, the
table, the results folder), driven by fake passes and by small real pytest runs."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from ddp_course import runtime
from ddp_course.harness import gpu_check
from ddp_course.harness.cli import main
from ddp_course.harness.gpu_check import NOT_STARTED, RESULTS_ENV


def test_without_a_gpu_it_says_so_in_one_line_and_runs_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(runtime, "gpu_count", lambda: 0)

    def must_not_run(*args, **kwargs):
        raise AssertionError("gpu-check started something on a machine without a GPU")

    monkeypatch.setattr(gpu_check.subprocess, "Popen", must_not_run)
    monkeypatch.setattr(gpu_check, "machine_info", must_not_run)
    out = tmp_path / "out"
    assert main(["gpu-check", "--out", str(out)]) == gpu_check.EXIT_NO_GPU != 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU is visible here")
    assert "nothing was run" in lines[0]
    assert not out.exists()


@pytest.mark.skipif(runtime.gpu_count() > 0, reason="this machine has a GPU")
def test_make_gpu_check_exits_non_zero_here(root):
    done = subprocess.run([sys.executable, "-m", "ddp_course", "gpu-check"], cwd=root,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done
    assert done.stdout.count("\n") == 1 and "no CUDA GPU" in done.stdout
    recipe = (root / "Makefile").read_text().split("\ngpu-check:")[1]
    assert "-m ddp_course gpu-check" in recipe.splitlines()[1]


def test_machine_info_names_the_versions_and_gpus():
    import torch

    info = gpu_check.machine_info()  # read by a child process
    assert info["torch"] == torch.__version__ and info["cuda"] == torch.version.cuda
    assert info["gpu_count"] == runtime.gpu_count() == len(info["gpus"])
    assert set(info) == {"python", "torch", "cuda", "cudnn", "nccl", "cpu_count", "gpu_count",
                         "gpus"}  # fmt: skip


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
    assert gpu_check.folder_name(names) == folder


def test_a_machine_without_gpus_has_no_folder_name():
    with pytest.raises(ValueError, match="no GPU names"):
        gpu_check.folder_name([])


def rec(nodeid, when, outcome, seconds=1.0, detail=""):
    return {"nodeid": nodeid, "when": when, "outcome": outcome, "seconds": seconds,
            "detail": detail}  # fmt: skip


def passed(nodeid, seconds=1.0):
    return [rec(nodeid, w, "passed", seconds) for w in ("setup", "call", "teardown")]


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
]
EXPECTED = [
    {"check": T + "test_ok", "outcome": "passed", "seconds": 6.0, "detail": ""},
    {"check": T + "test_broken", "outcome": "failed", "seconds": 5.0,
     "detail": "AssertionError: 1 != 2"},
    {"check": T + "test_bad_fixture", "outcome": "error", "seconds": 0.5,
     "detail": "RuntimeError: no port"},
    {"check": T + "test_two_gpus", "outcome": "skipped", "seconds": 0.0,
     "detail": "needs 2 or more CUDA GPUs; 1 visible"},
    {"check": "notebooks/05_ddp.ipynb", "outcome": "failed", "seconds": 12.0,
     "detail": "AssertionError: accuracy 0.1"},
    {"check": "notebooks/12_debugging.ipynb", "outcome": "not started", "seconds": 0.0,
     "detail": NOT_STARTED},
    {"check": "notebooks/11_multinode.ipynb", "outcome": "unfinished", "seconds": 4.0,
     "detail": "stopped at gpu-check's time limit"},
    {"check": "notebooks/13_bad.ipynb", "outcome": "error", "seconds": 0.0,
     "detail": "ValueError: not a notebook"},
]  # fmt: skip


def test_reports_become_one_row_per_test_and_per_notebook():
    assert gpu_check.collect_checks(RECORDS) == EXPECTED
    assert gpu_check.totals(EXPECTED) == {"failed": 2, "error": 2, "unfinished": 1,
                                          "passed": 1, "skipped": 1, "not started": 1}  # fmt: skip


@pytest.mark.parametrize(
    "outcomes, passes, status",
    [
        (["passed", "skipped"], [0], 0),
        (["passed", "not started"], [0], 3),
        (["passed", "failed", "not started"], [1], 1),
        (["passed", "unfinished"], [-9], 1),
        (["passed", "error"], [1], 1),
        (["passed"], [0, 5], 0),  # a pass that selects nothing is no failure
        (["passed"], [0, 3], 1),  # pytest's internal error: the pass may have run nothing
        (["passed"], [0, None], 3),  # a pass never started left its checks out
    ],
)
def test_exit_status(outcomes, passes, status):
    checks = [{"check": str(i), "outcome": o} for i, o in enumerate(outcomes)]
    runs = [{"what": str(i), "returncode": code} for i, code in enumerate(passes)]
    assert gpu_check.exit_status(checks, runs) == status


def test_summary_json_and_table(tmp_path):
    machine = {"torch": "2.13.0+cu130", "cuda": "13.0", "gpu_count": 1,
               "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_GiB": 79.2,
                         "capability": "9.0"}]}  # fmt: skip
    passes = [{"what": "GPU tests", "command": "python -m pytest tests/gpu/test_gpu.py",
               "returncode": 1, "seconds": 30.0}]  # fmt: skip
    path = gpu_check.write_summary(
        tmp_path / "gpu-x", command="python -m ddp_course gpu-check --budget-s 540",
        budget_s=540, wall_s=61.26, machine=machine, passes=passes, checks=EXPECTED,
        results=["b.json", "a.json"], utc="2026-11-23T09:00:00+00:00",
    )  # fmt: skip
    assert path == tmp_path / "gpu-x" / "gpu_check.json"
    summary = json.loads(path.read_text())
    assert summary == {
        "command": "python -m ddp_course gpu-check --budget-s 540",
        "utc": "2026-11-23T09:00:00+00:00", "budget_s": 540, "wall_s": 61.3,
        "machine": machine, "passes": passes, "checks": EXPECTED,
        "totals": gpu_check.totals(EXPECTED), "results": ["a.json", "b.json"],
    }  # fmt: skip
    table = gpu_check.format_table(EXPECTED, 61.26).splitlines()
    width = max(len(c["check"]) for c in EXPECTED) + 2  # the longest name, two spaces
    assert table[0].split() == ["check", "outcome", "seconds", "detail"]
    assert table[1] == f"{T + 'test_ok':<{width}}passed           6.0"
    assert table[2].startswith(f"{T + 'test_broken':<{width}}FAILED           5.0  Assert")
    assert table[6].startswith(f"{'notebooks/12_debugging.ipynb':<{width}}not started      0.0")
    assert table[7].split()[1] == "UNFINISHED"
    assert len(table) == len(EXPECTED) + 2
    assert (
        table[-1] == "2 failed, 2 error, 1 unfinished, 1 passed, 1 skipped, 1 not started in 61 s"
    )


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

    late = gpu_check._Plugin(None, deadline=time.time() - 1)
    late.started.add("notebooks/05_ddp.ipynb")  # began before the deadline
    must_run(late, "notebooks/05_ddp.ipynb::Cell 7")  # runs to its end
    for nodeid in ("notebooks/06_samplers.ipynb::Cell 0", "tests/gpu/test_gpu.py::test_x"):
        with pytest.raises(pytest.skip.Exception, match=NOT_STARTED):
            late.pytest_runtest_setup(Item(nodeid))
    early = gpu_check._Plugin(None, deadline=time.time() + 600)
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
    args = [*gpu_check.plugin_args(reports, deadline), *options, "-p", "no:cacheprovider",
            "--continue-on-collection-errors"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "pytest", *args], cwd=folder, capture_output=True,
                   timeout=300)  # fmt: skip
    records = gpu_check.read_records(reports)
    return {c["check"]: c for c in gpu_check.collect_checks(records)}, records


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


def test_gpu_check_runs_the_passes_and_keeps_what_they_wrote(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(runtime, "gpu_count", lambda: 2)
    machine = {"torch": "2.13.0+cu130", "cuda": "13.0", "gpu_count": 2,
               "gpus": [{"name": "NVIDIA H100 80GB HBM3"}] * 2}  # fmt: skip
    monkeypatch.setattr(gpu_check, "machine_info", lambda: machine)
    monkeypatch.setenv(runtime.DEVICE_ENV, "cpu")  # a leftover that would defeat the plan
    out = tmp_path / "gpu-nvidia-h100-80gb-hbm3-x2"
    out.mkdir()
    (out / "old.json").write_text("{}")  # a result of the previous run ...
    (out / "notes.json").write_text("{}")  # ... and a file someone put here
    (out / "gpu_check.json").write_text(json.dumps({"results": ["old.json", "../x.json"]}))
    seen = []

    per_pass = [
        [r for r in RECORDS if r["nodeid"].startswith(T)],  # the GPU tests
        [],  # the notebooks beside others: none here
        [
            r
            for r in RECORDS
            if r["nodeid"].split("::")[0]
            in ("notebooks/05_ddp.ipynb", "notebooks/12_debugging.ipynb")
        ],
    ]

    def fake_pytest(args, env, timeout_s):
        seen.append((args, env, timeout_s))
        reports = next(a.split("=", 1)[1] for a in args if a.startswith("--gpu-check-reports="))
        with open(reports, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in per_pass[len(seen) - 1])
        if len(seen) == 1:  # a GPU test keeps its script's results
            with open(f"{env[RESULTS_ENV]}/05_train_ddp.json", "w") as f:
                f.write('{"backend": "nccl"}')
        return 1

    status = gpu_check.gpu_check(100, out, runner=fake_pytest, command="gpu-check --budget-s 100")
    assert status == gpu_check.EXIT_FAILED and len(seen) == 3
    for args, env, timeout_s in seen:
        assert runtime.DEVICE_ENV not in env and env[RESULTS_ENV]
        assert 0 < timeout_s <= 100 + gpu_check.GRACE_S
        deadline = float(next(a.split("=")[1] for a in args if "deadline" in a))
        assert time.time() < deadline <= time.time() + 100
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["command"] == "gpu-check --budget-s 100" and summary["budget_s"] == 100
    assert summary["machine"] == machine
    assert [c["check"] for c in summary["checks"]] == [c["check"] for c in EXPECTED[:6]]
    assert summary["results"] == ["05_train_ddp.json"]
    assert json.loads((out / "05_train_ddp.json").read_text()) == {"backend": "nccl"}
    assert not (out / "old.json").exists() and (out / "notes.json").exists()
    assert [p["command"] for p in summary["passes"]] == [
        "python -m pytest --continue-on-collection-errors tests/gpu/test_gpu.py",
        "python -m pytest --continue-on-collection-errors -n 2 --dist loadfile -m 'not serial' "
        "tests/gpu/test_gpu.py notebooks --deselect tests/gpu/test_gpu.py",
        "python -m pytest --continue-on-collection-errors -m serial tests/gpu/test_gpu.py "
        "notebooks --deselect tests/gpu/test_gpu.py",
    ]
    printed = capsys.readouterr().out
    assert "\n" + gpu_check.format_table(summary["checks"], summary["wall_s"]) in printed
