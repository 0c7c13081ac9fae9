"""Lesson 04 times the same algorithms at N = 2, 3, 4 and fits one link model through
them, so every launch of the sweep must run on one device and backend.

``tools.bench.sweep_device_plan`` makes that plan once, for the largest N; notebook 04's
launch cell passes it to every launch. This machine has no GPU: the tests play machines
with 0 to 4 GPUs by patching ``runtime.gpu_count`` and run the notebook's own launch and
check cells with a recording launcher.
"""

import json
import pathlib
import types

import pytest
from notebook_cells import code_cell

import ddp_course.runtime
from ddp_course import runtime
from ddp_course.harness import launch
from ddp_course.tools.bench import link_label, sweep_device_plan


def notebook_cell(first_line: str) -> str:
    """The source of notebook 04's one code cell that starts with ``first_line``."""
    return code_cell("04_allreduce.ipynb", first_line)


@pytest.mark.parametrize(
    ("gpus", "device_type"),
    [(0, "cpu"), (1, "cpu"), (2, "cpu"), (3, "cpu"), (4, "cuda"), (8, "cuda")],
)
def test_the_sweep_runs_on_one_device_planned_for_its_largest_world_size(gpus, device_type):
    plan = sweep_device_plan((2, 3, 4), gpus)
    assert (plan.device_type, plan.backend) == (
        device_type,
        {"cpu": "gloo", "cuda": "nccl"}[device_type],
    )
    assert plan.fallback == (0 < gpus < 4)
    # Where each launch planned alone would pick another device, the sweep plan wins.
    alone = {n: runtime.device_plan(n, gpus).device_type for n in (2, 3, 4)}
    assert plan.device_type == alone[4]


def test_the_gpu_count_comes_from_runtime(monkeypatch):
    monkeypatch.setattr(ddp_course.runtime, "gpu_count", lambda: 2)
    assert sweep_device_plan((2,)).device_type == "cuda"
    assert sweep_device_plan((2, 3, 4)).device_type == "cpu"


def test_bad_sweeps_raise():
    with pytest.raises(ValueError, match="world size"):
        sweep_device_plan((), 2)
    with pytest.raises(ValueError, match="world size"):
        sweep_device_plan((0, 2), 2)
    with pytest.raises(ValueError, match="gpu_count"):
        sweep_device_plan((2,), -1)


def test_link_labels_name_what_ran():
    assert "loopback TCP" in link_label("gloo", "cpu")
    assert "NVLink" in link_label("nccl", "cuda:0")
    assert "CUDA tensors" in link_label("gloo", "cuda:1")
    with pytest.raises(ValueError, match="mpi"):
        link_label("mpi", "cpu")


# --- notebook 04's launch cell and its check, with a recording launcher -------------


def run_launch_cells(monkeypatch, tmp_path, gpus: int, ran_on=None) -> list[dict]:
    """Run notebook 04's parameters, launch and check cells on a machine with ``gpus``
    GPUs. Every launch is recorded, not run; it "runs" where its env says, or on
    ``ran_on(n)`` (backend, device) when given. Returns the recorded launches."""
    monkeypatch.setattr(ddp_course.runtime, "gpu_count", lambda: gpus)
    monkeypatch.chdir(tmp_path)
    calls = []

    def torchrun(script, args=(), nproc=2, env=None, **kwargs):
        planned = (env or {}).get(runtime.DEVICE_ENV)
        if planned is None:  # the launcher's own plan for this N alone
            planned = runtime.device_plan(nproc, gpus).device_type
        calls.append({"nproc": nproc, "device": planned})
        if ran_on is not None:
            backend, device = ran_on(nproc)
        else:
            backend, device = {"cpu": ("gloo", "cpu"), "cuda": ("nccl", "cuda:0")}[planned]
        results = {
            "world_size": nproc,
            "backend": backend,
            "device": device,
            "checks": {"cases": 24},
        }
        return types.SimpleNamespace(results=results, output="")

    monkeypatch.setattr(launch, "torchrun", torchrun)
    namespace = {"launch": launch, "runtime": runtime, "json": json, "pathlib": pathlib}
    namespace.update(sweep_device_plan=sweep_device_plan, link_label=link_label)
    for first_line in (
        "WORLD_SIZES = ",
        "plan = sweep_device_plan(",
        "for n, run in runs.items():",
    ):
        exec(notebook_cell(first_line), namespace)
    return calls


@pytest.mark.parametrize(
    ("gpus", "device"), [(0, "cpu"), (1, "cpu"), (2, "cpu"), (3, "cpu"), (4, "cuda")]
)
def test_the_notebook_launches_every_world_size_on_one_plan(gpus, device, monkeypatch, tmp_path):
    calls = run_launch_cells(monkeypatch, tmp_path, gpus)
    assert [c["nproc"] for c in calls] == [2, 3, 4]
    assert {c["device"] for c in calls} == {device}


def test_the_notebook_check_fails_on_a_mixed_sweep(monkeypatch, tmp_path):
    # N = 2 on nccl, N = 3 and 4 on gloo: what per-launch plans give on a 2-GPU machine.
    def mixed(n):
        return ("nccl", "cuda:0") if n == 2 else ("gloo", "cpu")

    with pytest.raises(AssertionError):
        run_launch_cells(monkeypatch, tmp_path, 2, ran_on=mixed)


def test_the_sweep_plan_runs_a_two_rank_launch_on_cpu_where_two_gpus_would_take_it(root):
    # On a "2-GPU machine" the launcher alone would put 2 ranks on cuda:0 and cuda:1
    # (and fail here, where there is no GPU); the sweep's plan keeps them on the CPU.
    plan = sweep_device_plan((2, 3, 4), gpus=2)
    job = launch.torchrun(
        root / "scripts/04_allreduce.py",
        ["--max-bytes", "0"],
        nproc=2,
        gpus=2,
        env={runtime.DEVICE_ENV: plan.device_type},
        results=True,
        echo=False,
        timeout_s=180,
    )
    assert (job.results["backend"], job.results["device"]) == ("gloo", "cpu")


# --- the recorded reference run the notebook reads ------------------------------------


def test_the_recorded_reference_run_has_the_shape_the_notebook_describes(
    root, monkeypatch, tmp_path
):
    # Notebook 04 times a short live sweep on whatever load the machine has, and describes
    # the shape of its curves from benchmarks/cpu-2core/04_allreduce.json, a run of the
    # script's defaults on a quiet 2-core machine. These are that description's claims; they
    # fail when the file is recorded again and no longer shows them.
    monkeypatch.chdir(tmp_path)
    parameters = {"pathlib": pathlib}
    exec(notebook_cell("WORLD_SIZES = "), parameters)
    reference = json.loads((root / "benchmarks/cpu-2core/04_allreduce.json").read_text())
    sizes, sweep = reference["sizes"], reference["sweep"]
    assert set(sweep) == {"torch", "ring", "ps", "send", "exchange"}
    for name, row in sweep.items():
        t = row["median_s"]
        for s in parameters["SCALING_BYTES"]:  # the sizes timed with 3 and 4 ranks
            assert t[sizes.index(s)] > 2 * t[0], (name, s)  # latency: under half the time
        assert abs(reference["fits"][name]["alpha_s"]) < 0.1 * t[-1], name  # alpha is small
        assert row["busbw_GBps"][-1] > 10 * row["busbw_GBps"][0], name  # busbw rises with S
    meta = reference["meta"]  # recorded on 2 cores, not saturated
    assert meta["machine"]["cpus"] == 2 and meta["load_average_1min"] < meta["machine"]["cpus"]
