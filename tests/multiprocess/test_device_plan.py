"""The course's device rule: CUDA and nccl only when every local rank has its own GPU,
otherwise CPU and gloo; applied by the launcher and honoured by every worker."""

import ast
import json
import pathlib

import pytest
import torch

from ddp_course import runtime
from ddp_course.harness import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ranks_devices(nproc: int, gpus: int) -> list[torch.device]:
    """The device each local rank gets under the launcher's plan, as a worker decides it."""
    plan = runtime.device_plan(nproc, gpus)
    return [runtime.device_for_rank(r, gpus, plan.device_type) for r in range(nproc)]


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_every_rank_gets_a_device_of_its_own(nproc, gpus):
    plan = runtime.device_plan(nproc, gpus)
    devices = ranks_devices(nproc, gpus)
    assert {d.type for d in devices} == {plan.device_type}
    assert plan.backend == runtime.pick_backend(devices[0])
    if plan.device_type == "cuda":
        # One GPU per rank: distinct indices that exist on the node.
        assert sorted(d.index for d in devices) == list(range(nproc))
        assert nproc <= gpus
    # GPUs are used whenever they can be, and the fallback is said.
    assert (plan.device_type == "cuda") == (0 < nproc <= gpus)
    assert plan.fallback == (0 < gpus < nproc)
    assert plan.reason.startswith(f"{nproc} rank")
    if plan.fallback:
        assert "CPU with gloo" in plan.reason and f"{gpus} GPU" in plan.reason


def test_the_fallback_line_reads_well():
    plan = runtime.device_plan(2, 1)
    assert plan.reason == "2 ranks, 1 GPU: running on CPU with gloo so every rank has a device"
    assert runtime.device_plan(2, 2).reason == "2 ranks, 2 GPUs: one GPU per rank with nccl"


@pytest.mark.parametrize("gpus", [1, 2])
def test_plain_torchrun_with_too_many_ranks_gets_the_clear_error(gpus):
    # No plan (a script started by hand with torchrun): one rank per GPU, or an error.
    assert runtime.device_for_rank(gpus - 1, gpus) == torch.device("cuda", gpus - 1)
    with pytest.raises(RuntimeError, match=f"local rank {gpus} has no GPU.*nproc_per_node={gpus}"):
        runtime.device_for_rank(gpus, gpus)
    assert runtime.device_for_rank(gpus, gpus, "cpu") == torch.device("cpu")
    assert runtime.device_for_rank(3, 0) == torch.device("cpu")


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="nproc_per_node must be at least 1"):
        runtime.device_plan(0, 1)
    with pytest.raises(ValueError, match="gpu_count cannot be negative"):
        runtime.device_plan(1, -1)
    with pytest.raises(ValueError, match="DDP_COURSE_DEVICE must be 'cpu' or 'cuda'"):
        runtime.device_for_rank(0, 1, "tpu")


def test_distributed_honours_the_plan_in_the_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", runtime.DEVICE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(runtime, "_gpu_count", lambda: 1)  # a one-GPU laptop
    with pytest.raises(RuntimeError, match="local rank 1 has no GPU"):
        with runtime.distributed():
            pass
    assert runtime.pick_device(0) == torch.device("cuda", 0)  # a device object; no CUDA used
    monkeypatch.setenv(runtime.DEVICE_ENV, "cpu")
    with runtime.distributed() as ctx:
        assert ctx.device == torch.device("cpu")
    assert runtime.pick_device(0) == torch.device("cpu")
    monkeypatch.setenv(runtime.DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="must be 'cpu' or 'cuda'"):
        runtime.pick_device(0)


# --- every launch in the notebooks gets a runnable plan on a 1- and a 2-GPU machine ---


def _code(cell: dict) -> str:
    # IPython magics and shell lines are not Python; a %%writefile cell is a script.
    lines = "".join(cell["source"]).splitlines()
    if lines and lines[0].startswith("%%"):
        return ""
    return "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


def _int_values(node: ast.AST, bindings: dict[str, list[ast.AST]], depth: int = 0) -> set[int]:
    """The integers an expression can take, following names bound in the notebook
    (every binding of a name anywhere in it: more values than run, never fewer)."""
    if depth > 5:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_int_values(e, bindings, depth + 1) for e in node.elts))
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "range":
        try:
            return set(range(*(ast.literal_eval(a) for a in node.args)))
        except ValueError:
            return set()
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        # ``2 * NPROC_PER_NODE``: every combination of the two sides' values.
        left = _int_values(node.left, bindings, depth + 1)
        right = _int_values(node.right, bindings, depth + 1)
        combine = (lambda a, b: a + b) if isinstance(node.op, ast.Add) else (lambda a, b: a * b)
        return {combine(a, b) for a in left for b in right}
    if isinstance(node, ast.Name):
        found = set()
        for value in bindings.get(node.id, []):
            found |= _int_values(value, bindings, depth + 1)
        return found
    return set()


def _bindings(tree: ast.AST) -> dict[str, list[ast.AST]]:
    """Every expression bound to a name: assignments, loop and comprehension
    variables, and keyword arguments of the notebook's own functions
    (``short_run(nproc=1)`` binds ``short_run``'s parameter ``nproc``)."""
    bound: dict[str, list[ast.AST]] = {}
    params = {
        node.name: {a.arg for a in node.args.args + node.args.kwonlyargs}
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.For | ast.comprehension):
            if isinstance(node.target, ast.Name):
                bound.setdefault(node.target.id, []).append(node.iter)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in params:
            for keyword in node.keywords:
                if keyword.arg in params[node.func.id]:
                    bound.setdefault(keyword.arg, []).append(keyword.value)
    return bound


def _gpu_count_in(node: ast.AST, bindings: dict[str, list[ast.AST]]) -> bool:
    """Whether the expression reads a name bound to ``torch.cuda.device_count()``."""
    return any(
        isinstance(value, ast.Call) and getattr(value.func, "attr", None) == "device_count"
        for name in ast.walk(node)
        if isinstance(name, ast.Name)
        for value in bindings.get(name.id, [])
    )


def notebook_launches() -> list[tuple[str, int]]:
    """``(notebook, nproc)`` for every ``torchrun(...)`` call in the notebooks' code cells."""
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        source = "\n".join(_code(c) for c in cells if c["cell_type"] == "code")
        tree = ast.parse(source)
        bindings = _bindings(tree)
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            name = getattr(func, "attr", None) or getattr(func, "id", None)
            if not isinstance(node, ast.Call) or name != "torchrun":
                continue
            nproc = next((k.value for k in node.keywords if k.arg == "nproc"), None)
            if nproc is not None and _gpu_count_in(nproc, bindings):
                # Sized from this machine's GPUs (GPU-only cells): one rank per GPU is
                # runnable by construction; any other count must override the plan on
                # purpose, to show the error a rank without a GPU gets.
                env = next((k.value for k in node.keywords if k.arg == "env"), None)
                overrides = env is not None and "DDP_COURSE_DEVICE" in ast.unparse(env)
                assert isinstance(nproc, ast.Name) or overrides, (
                    f"{path.name} line {node.lineno}: nproc={ast.unparse(nproc)} is not one "
                    "rank per GPU"
                )
                continue
            values = {2} if nproc is None else _int_values(nproc, bindings)  # 2: the default
            assert values, (
                f"{path.name} line {node.lineno}: cannot read nproc={ast.unparse(nproc)}; "
                "give it a number or a name assigned a number in the notebook"
            )
            found += [(path.name, n) for n in sorted(values)]
    return found


def test_the_scan_finds_the_lessons_launches():
    launches = notebook_launches()
    notebooks = {name for name, _ in launches}
    assert {"00_course_setup.ipynb", "05_ddp.ipynb"} <= notebooks
    assert {n for _, n in launches} >= {1, 2}


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_notebook_launch_has_a_runnable_plan(gpus):
    for notebook, nproc in notebook_launches():
        devices = ranks_devices(nproc, gpus)
        assert len(devices) == nproc, notebook
        cuda = [d.index for d in devices if d.type == "cuda"]
        assert len(set(cuda)) == len(cuda) and all(i < gpus for i in cuda), (notebook, nproc)


# --- end to end: the launcher believes there is one GPU, the workers run on CPU ---


def test_launcher_falls_back_to_cpu_and_the_workers_follow(workers, capsys):
    job = launch.torchrun(
        workers / "launch_sleep.py", ["--pretend-gpus", "1"], nproc=2, gpus=1,
        results=True, timeout_s=120,
    )  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "2 ranks, 1 GPU: running on CPU with gloo so every rank has a device"
    assert printed[1].startswith("$ DDP_COURSE_DEVICE=cpu torchrun --nproc_per_node=2 ")
    assert job.results["device"] == "cpu" and job.results["backend"] == "gloo"
    for rank in (0, 1):
        assert f"rank {rank}: device cpu, backend gloo, DDP_COURSE_DEVICE=cpu" in job.logs[rank]


def test_a_one_process_reference_runs_where_the_ranks_of_its_job_run(workers, capsys):
    # One GPU, a 2-rank job: its ranks run on CPU, so its one-process reference must
    # too (on cuda:0 the two would be compared across devices).
    job = launch.python(
        workers / "launch_sleep.py", ["--pretend-gpus", "1"], reference_for=2, gpus=1,
        results=True, timeout_s=120,
    )  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "2 ranks, 1 GPU: running on CPU with gloo so every rank has a device"
    assert printed[1].startswith("$ DDP_COURSE_DEVICE=cpu python ")
    assert job.results["device"] == "cpu"
    assert "DDP_COURSE_DEVICE=cpu" in job.logs[0]


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_reference_and_job_get_the_same_device_type(monkeypatch, nproc, gpus):
    # What launch.python(reference_for=nproc) passes to its process is what
    # launch.torchrun(nproc=nproc) passes to every rank, on every GPU count.
    for name in (runtime.DEVICE_ENV,):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    ref_env, _ = launch.planned_env(None, nproc, None)
    job_env, _ = launch.planned_env(None, nproc, gpus)
    assert ref_env[runtime.DEVICE_ENV] == job_env[runtime.DEVICE_ENV]
    assert ref_env[runtime.DEVICE_ENV] == ("cuda" if 0 < nproc <= gpus else "cpu")
    # A plain run (reference_for=1) uses a GPU whenever there is one.
    plain, _ = launch.planned_env(None, 1, None)
    assert plain[runtime.DEVICE_ENV] == ("cuda" if gpus else "cpu")


def test_reference_for_must_be_a_rank_count(workers):
    with pytest.raises(ValueError, match="reference_for must be at least 1"):
        launch.python(workers / "launch_sleep.py", reference_for=0)


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("replicas", [None, 1, 2, 3, 4])
def test_data_parallel_replicas_never_share_a_gpu(replicas, gpus):
    devices = runtime.replica_devices(replicas, gpus)
    assert len(devices) == (replicas or gpus or 2)
    cuda = [d.index for d in devices if d.type == "cuda"]
    assert len(set(cuda)) == len(cuda) and all(i < gpus for i in cuda)
    # All on GPUs or all on the CPU, GPUs whenever each replica can have one.
    assert {d.type for d in devices} == {"cuda" if 0 < len(devices) <= gpus else "cpu"}
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        runtime.replica_devices(0, gpus)


def test_no_tf32_turns_tensor_float_32_off_for_matmuls_and_convolutions(monkeypatch):
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has the allow_tf32 flags only")
    before = matmul.fp32_precision, cudnn.conv.fp32_precision
    try:
        cudnn.conv.fp32_precision = "tf32"  # torch's default for convolutions
        runtime.no_tf32()
        assert (matmul.fp32_precision, cudnn.conv.fp32_precision) == ("ieee", "ieee")
    finally:
        matmul.fp32_precision, cudnn.conv.fp32_precision = before


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("RuntimeError: [gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms", True),
        (
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, "
            "OpType=ALLREDUCE, Timeout(ms)=5000) ran for 5004 milliseconds before timing out.",
            True,
        ),  # fmt: skip
        ("torch.distributed.DistStoreError: Timed out after 31 seconds waiting for clients", True),
        ("RuntimeError: Connection closed by peer [127.0.0.1]:29500", False),
        ("loss 0.31 after 12 steps", False),
    ],
)
def test_a_timeout_is_recognised_on_both_backends(text, expected):
    assert launch.is_timeout(text) is expected
