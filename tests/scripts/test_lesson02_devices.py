"""Lesson 02's device choices on machines with 0, 1, 2 and 4 GPUs, without a GPU.

Every decision reads ``runtime.gpu_count()``; the tests patch it (and torch's
own CUDA queries, so that code asking torch directly would see the same
machine) and check the from-scratch DataParallel's default devices, the
script's choice of implementation and devices, and that notebook 02 builds
every DataParallel from the device plan of its parameters cell.
"""

import ast
import importlib.util
import json
import pathlib
import re

import pytest
import torch
from torch import nn

from ddp_course import data_parallel, runtime
from ddp_course.replica_plan import plan_replicas

ROOT = pathlib.Path(__file__).resolve().parents[2]

CPU = torch.device("cpu")
GPU_COUNTS = [0, 1, 2, 4]
REPLICA_COUNTS = [None, 1, 2, 3, 4]
NOTEBOOK = ROOT / "notebooks" / "02_data_parallel.ipynb"
SCRIPT = ROOT / "scripts" / "02_train_dp.py"


@pytest.fixture
def machine(monkeypatch):
    """Play a machine with ``gpus`` GPUs: the course's count and torch's agree."""

    def play(gpus: int) -> None:
        monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    return play


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("lesson02_train_dp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only: main() runs under __main__
    return module


def expected_devices(replicas, gpus):
    n = replicas or gpus or 2
    return [torch.device("cuda", i) for i in range(n)] if n <= gpus else [CPU] * n


# --- ddp_course.data_parallel.DataParallel's default devices -------------------------------


@pytest.mark.parametrize("gpus", GPU_COUNTS)
@pytest.mark.parametrize("replicas", REPLICA_COUNTS)
def test_default_devices_never_share_a_gpu(machine, replicas, gpus):
    machine(gpus)
    # A module without tensors: on this CPU machine no tensor can live on cuda:0.
    dp = data_parallel.DataParallel(nn.Identity(), num_replicas=replicas)
    assert dp.devices == expected_devices(replicas, gpus)
    assert dp.devices == runtime.replica_devices(replicas, gpus)
    cuda = [d.index for d in dp.devices if d.type == "cuda"]
    assert len(cuda) == len(set(cuda)), f"two replicas share a GPU: {dp.devices}"
    assert dp.output_device == dp.devices[0]


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_default_devices_read_the_courses_gpu_count(monkeypatch, gpus):
    # Only runtime.gpu_count is patched: torch itself still reports this machine's GPUs.
    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    dp = data_parallel.DataParallel(nn.Identity(), num_replicas=2)
    assert dp.devices == expected_devices(2, gpus)


@pytest.mark.parametrize("gpus", [1, 2])
def test_too_few_gpus_fall_back_to_cpu_threads_that_train(machine, gpus):
    machine(gpus)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)  # on the CPU, where the fallback puts the replicas
    dp = data_parallel.DataParallel(model, num_replicas=gpus + 1)
    assert dp.devices == [CPU] * (gpus + 1)
    x = torch.randn(8, 6)
    torch.testing.assert_close(dp(x), model(x))


def test_explicit_devices_are_kept(machine):
    machine(4)
    dp = data_parallel.DataParallel(nn.Identity(), devices=["cpu", "cpu"])
    assert dp.devices == [CPU, CPU]


def test_a_model_off_the_first_device_is_refused(machine):
    machine(2)
    with pytest.raises(ValueError, match=r"must be on devices\[0\] = cuda:0"):
        data_parallel.DataParallel(nn.Linear(2, 2))  # two GPUs, the model on the CPU


# --- the choice of implementation and devices ------------------------------------------


@pytest.mark.parametrize("gpus", GPU_COUNTS)
@pytest.mark.parametrize("replicas", REPLICA_COUNTS)
@pytest.mark.parametrize("impl", ["auto", "torch", "scratch"])
def test_script_device_choice(machine, script, impl, replicas, gpus):
    machine(gpus)
    devices = expected_devices(replicas, gpus)
    on_gpus = devices[0].type == "cuda"
    here = torch.device("cuda", 0) if gpus else CPU  # where the launcher puts the process
    if impl == "torch" and not on_gpus:
        with pytest.raises(SystemExit) as info:
            script.replica_plan(impl, replicas, here)
        message = str(info.value)
        assert "--impl scratch" in message and "needs" in message
        if gpus:
            assert f"at most {gpus} replicas" in message
        return
    plan = script.replica_plan(impl, replicas, here)
    assert plan.devices == devices
    assert plan.impl == ("torch" if impl == "torch" or (impl == "auto" and on_gpus) else "scratch")
    cuda = [d.index for d in plan.devices if d.type == "cuda"]
    assert len(cuda) == len(set(cuda)) and all(i < gpus for i in cuda)
    assert plan.reason.startswith(f"{len(devices)} replica")


@pytest.mark.parametrize("impl", ["auto", "scratch"])
def test_script_on_a_cpu_plan_ignores_the_gpus(machine, script, impl):
    # DDP_COURSE_DEVICE=cpu puts the process on the CPU: no replica goes to a GPU.
    machine(4)
    plan = script.replica_plan(impl, 2, CPU)
    assert (plan.impl, plan.devices) == ("scratch", [CPU, CPU])


def test_script_wraps_on_the_planned_devices(machine, script):
    machine(1)
    plan = script.replica_plan("auto", 3, torch.device("cuda", 0))
    model = script.wrap(nn.Linear(2, 2), plan)
    assert isinstance(model, data_parallel.DataParallel) and model.devices == [CPU] * 3


def test_script_labels_its_memory(monkeypatch, script):
    monkeypatch.setattr(script, "memory_bytes", lambda device: 7)
    gpus = script.memory_used([torch.device("cuda", 0), torch.device("cuda", 1)])
    assert gpus == {"kind": "cuda max_memory_allocated", "bytes": {"cuda:0": 7, "cuda:1": 7}}
    cpu = script.memory_used([CPU, CPU])
    assert "RSS" in cpu["kind"] and cpu["bytes"] == {"process": 7}


def test_plan_replicas_rejects_an_unknown_impl():
    with pytest.raises(ValueError, match="impl must be"):
        plan_replicas("threads", 2, 0)


# --- clocks wait for the GPUs -----------------------------------------------------------


def test_clock_synchronises_each_gpu_once(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    data_parallel.clock(["cpu", "cuda:1", torch.device("cuda", 0), "cuda:1"])
    assert waited == [torch.device("cuda", 1), torch.device("cuda", 0)]
    waited.clear()
    data_parallel.clock([CPU, CPU])
    assert waited == []


def test_timings_are_read_with_the_synchronising_clock(monkeypatch):
    reads = []
    real = data_parallel.clock

    def counting(devices=()):
        reads.append(list(devices))
        return real(devices)

    monkeypatch.setattr(data_parallel, "clock", counting)
    dp = data_parallel.DataParallel(nn.Linear(4, 2), devices=["cpu", "cpu"])
    dp(torch.randn(6, 4)).sum().backward()
    assert len(reads) == 7  # five in forward, two around the gradient sum in backward
    assert set(dp.timings) == {"scatter", "replicate", "parallel_apply", "gather", "reduce"}


def test_script_reads_no_unsynchronised_clock():
    assert "perf_counter" not in SCRIPT.read_text()


# --- notebook 02 builds every DataParallel from the device plan ------------------------


def _code(source: str) -> str:
    # Remove IPython magics so that ast can parse the cell.
    return "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()
    )


def _cells():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return [s for s in sources if not s.startswith("%%writefile")]


def _plan_names(cells) -> set[str]:
    """Names assigned from ``runtime.replica_devices(...)`` anywhere in the notebook."""
    names = set()
    for source in cells:
        for node in ast.walk(ast.parse(_code(source))):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func).endswith("replica_devices")
            ):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_the_parameters_cell_takes_the_devices_from_the_plan():
    cells = _cells()
    params = next(s for s in cells if s.startswith("# Parameters"))
    assert re.search(r"^DEVICES = runtime\.replica_devices\(REPLICAS, GPUS\)", params, re.M)
    assert re.search(r"^GPUS = runtime\.gpu_count\(\)", params, re.M)
    assert re.search(r"^DEVICE = DEVICES\[0\]", params, re.M)
    assert "print(" in params  # says where the replicas run, and why


def test_every_data_parallel_of_the_notebook_uses_the_plan():
    cells = _cells()
    plan = _plan_names(cells)
    assert {"DEVICES", "TIMING_DEVICES"} <= plan
    built = 0
    for source in cells:
        tree = ast.parse(_code(source))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and ast.unparse(call.func).endswith("DataParallel")):
                continue
            built += 1
            text = ast.unparse(call)
            keywords = {k.arg: k.value for k in call.keywords}
            if ast.unparse(call.func) == "data_parallel.DataParallel":
                # The from-scratch version: devices given, from the plan (never its default).
                assert "devices" in keywords, f"no devices= in {text}"
                used = {n.id for n in ast.walk(keywords["devices"]) if isinstance(n, ast.Name)}
                assert used & plan, f"{text}: devices not from the plan {sorted(plan)}"
            elif "device_ids" in keywords:
                used = {n.id for n in ast.walk(keywords["device_ids"]) if isinstance(n, ast.Name)}
                assert used & plan, f"{text}: device_ids not from the plan {sorted(plan)}"
            else:
                # torch's default (every GPU): the cell places its models on the plan's device.
                assert "DEVICE" in names, f"{text}: the cell does not use DEVICE\n{source}"
    assert built >= 8


def test_the_notebook_reads_no_unsynchronised_clock():
    for source in _cells():
        assert "perf_counter()" not in _code(source), source
