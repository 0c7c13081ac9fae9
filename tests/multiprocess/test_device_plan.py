"""The course's device rule: CUDA and nccl only when every local rank has its own GPU,
otherwise CPU and gloo; applied by the launcher and honoured by every worker."""

import pathlib

import pytest
import torch

from ddp_course import runtime
from ddp_course.harness import launch, launch_scan, multinode

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


# --- every launch in the notebooks gets a runnable plan on a 0-, 1-, 2- and 4-GPU machine ---
# The scan (ddp_course.harness.launch_scan) reads every way a notebook starts ranks:
# launch.torchrun, multinode.torchrun_nodes, launch.python and torch.cuda in its own kernel.

LAUNCHES = launch_scan.scan(ROOT / "notebooks")


def test_the_scan_finds_every_kind_of_launch_in_the_lessons():
    found = {(x.notebook, x.kind) for x in LAUNCHES}
    assert {("00_course_setup.ipynb", "torchrun"), ("05_ddp.ipynb", "torchrun")} <= found
    assert ("11_multinode.ipynb", "torchrun_nodes") in found
    assert ("01_training_loop.ipynb", "python") in found
    assert ("14_activation_memory.ipynb", "torch.cuda") in found
    assert {n for x in LAUNCHES for n in x.nproc} >= {1, 2, 4}
    # GPU-only cells sized from the machine (one rank per GPU) and behind `if gpus ...`.
    sized = [x for x in LAUNCHES if x.per_gpu is not None]
    assert {x.notebook for x in sized} >= {"05_ddp.ipynb", "10_benchmarking.ipynb"}
    assert all(x.guards for x in sized)


def test_simulated_nodes_always_run_on_their_own_device():
    nodes = [x for x in LAUNCHES if x.kind == "torchrun_nodes"]
    assert len(nodes) >= 5
    for gpus in (0, 1, 2, 4):
        assert {t for x in nodes for t in x.device_types(gpus)} == {
            multinode.SIMULATED_NODES_DEVICE
        }


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_every_notebook_launch_has_a_runnable_plan(gpus):
    checked = 0
    for x in LAUNCHES:
        if x.kind == "torch.cuda" or x.fails_on_purpose(gpus):
            continue  # one process on cuda:0; a lesson showing a rank without a GPU
        for nproc in x.ranks(gpus):
            device = x.device_type(nproc, gpus)
            if x.kind == "torchrun_nodes":
                # Every node's local rank 0 would take cuda:0: simulated nodes never use GPUs.
                assert device == "cpu", x.where()
                continue
            devices = [runtime.device_for_rank(r, gpus, device) for r in range(nproc)]
            cuda = [d.index for d in devices if d.type == "cuda"]
            # No GPU twice, none that the machine lacks.
            assert len(set(cuda)) == len(cuda) and all(i < gpus for i in cuda), (x, nproc)
            checked += 1
    assert checked > 50


def test_only_a_lesson_that_shows_the_error_puts_a_rank_without_a_gpu_on_cuda():
    on_purpose = {x.where() for g in (1, 2, 4) for x in LAUNCHES if x.fails_on_purpose(g)}
    assert {w.split(" ")[0] for w in on_purpose} <= {"12_debugging.ipynb"}


# --- end to end: the launcher believes there is one GPU, the workers run on CPU ---


@pytest.mark.parametrize("launcher", ["torchrun", "python"])
def test_launcher_falls_back_to_cpu_and_the_workers_follow(workers, capsys, launcher):
    # One GPU, a 2-rank job: its ranks run on CPU, and so must its one-process
    # reference (launch.python(reference_for=2); on cuda:0 the two would be compared
    # across devices).
    ranks = {"nproc": 2} if launcher == "torchrun" else {"reference_for": 2}
    job = getattr(launch, launcher)(
        workers / "launch_sleep.py",
        ["--pretend-gpus", "1"],
        gpus=1,
        results=True,
        timeout_s=120,
        **ranks,
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "2 ranks, 1 GPU: running on CPU with gloo so every rank has a device"
    assert printed[1].startswith(f"$ DDP_COURSE_DEVICE=cpu {launcher} ")
    assert job.results["device"] == "cpu"
    for rank in range(2 if launcher == "torchrun" else 1):
        assert f"rank {rank}: device cpu, backend " in job.logs[rank]
        assert "DDP_COURSE_DEVICE=cpu" in job.logs[rank]
    if launcher == "torchrun":
        assert job.results["backend"] == "gloo"


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
        ),
        ("torch.distributed.DistStoreError: Timed out after 31 seconds waiting for clients", True),
        ("RuntimeError: Connection closed by peer [127.0.0.1]:29500", False),
        ("loss 0.31 after 12 steps", False),
    ],
)
def test_a_timeout_is_recognised_on_both_backends(text, expected):
    assert launch.is_timeout(text) is expected
