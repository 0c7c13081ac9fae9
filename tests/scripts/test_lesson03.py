"""Lesson 03's scripts as plain python and under torchrun: 03_process_groups.py with 1 and
2 ranks (four process groups one after another, every store rank 0 serves on loopback
only), 03_collectives.py with 3 ranks (subgroups). Notebook 03 asserts the 2-rank run of
03_process_groups.py further (torchrun's variables, the job's sockets).

Two of notebook 03's checks must hold on gloo and on nccl alike, and this machine has no
GPU: the tests below run those notebook cells themselves against records of the shape a
1-GPU, 2-GPU or CPU machine produces, with ``runtime.gpu_count`` patched.
"""

import pathlib

import pytest
from notebook_cells import code_cell

import ddp_course.runtime
from ddp_course import runtime
from ddp_course.harness import launch


def notebook_cell(first_line: str) -> str:
    """The source of notebook 03's one code cell that starts with ``first_line``."""
    return code_cell("03_collectives.ipynb", first_line)


def fourth_group(device: str) -> str:
    """The name of 03_process_groups.py's fourth group on ranks that run on ``device``."""
    return "cpu:gloo,cuda:nccl + device_id" if device.startswith("cuda") else "cpu:gloo"


def check_own_stores(r: dict, env_store: list[str]) -> None:
    """Rank 0 served the tcp:// store, the fourth group's and the side store on 127.0.0.1
    only; ``env_store`` is where it served env://'s (none under torchrun: the agent's)."""
    served = {
        m: got["store_listens_on"] for m, got in r["init"].items() if "store_listens_on" in got
    }
    loopback = ["127.0.0.1"]
    assert served == {
        "env://": env_store,
        "tcp://": loopback,
        fourth_group(r["device"]): loopback,
    }, served
    assert r["side_store_listens_on"] == loopback


def test_process_groups_as_plain_python(root):
    job = launch.python(root / "scripts/03_process_groups.py", results=True, echo=False)
    r = job.results
    assert r["world_size"] == 1
    assert list(r["init"]) == ["env://", "tcp://", "file://", fourth_group(r["device"])]
    assert all(got["sum"] == 1 for got in r["init"].values()), r["init"]
    # One process: cuda:0 where there is a GPU, else the CPU; torch's default backend fits.
    assert r["device"] == ("cuda:0" if runtime.gpu_count() else "cpu")
    assert r["backend_argument"] is None
    check_own_stores(r, env_store=["127.0.0.1"])  # plain python: rank 0 serves env:// too


@pytest.mark.parametrize("nproc", [1, 2])
def test_process_groups_under_torchrun(root, nproc):
    # The fourth group comes after env:// under torchrun, whose store is the agent's: it
    # must get a store of its own, or rank 0 tries to serve the agent's port (EADDRINUSE).
    job = launch.torchrun(
        root / "scripts/03_process_groups.py", nproc=nproc, results=True, echo=False, timeout_s=180
    )
    r = job.results
    plan = runtime.device_plan(nproc, runtime.gpu_count())
    assert r["world_size"] == nproc and r["device"].split(":")[0] == plan.device_type
    assert list(r["init"]) == ["env://", "tcp://", "file://", fourth_group(r["device"])]
    total = nproc * (nproc + 1) // 2
    assert all(got["sum"] == total for got in r["init"].values()), r["init"]
    check_own_stores(r, env_store=[])


def test_collectives_subgroups_with_three_ranks(root):
    job = launch.torchrun(root / "scripts/03_collectives.py", nproc=3, results=True, echo=False)
    subs = [record["subgroup"] for record in job.results["ranks"]]
    assert [s["members"] for s in subs] == [[0, 2], [1], [0, 2]]
    assert [s["sum"] for s in subs] == [2, 1, 2]  # each half's ranks, not the world's 3
    assert [s["rank_in_group"] for s in subs] == [0, 0, 1]


# --- notebook 03's init-method check, on machines with 0, 1 and 2 GPUs ----------------

THREE = ["env://", "tcp://", "file://"]
FOUR_CPU = [*THREE, "cpu:gloo"]
FOUR_GPU = [*THREE, "cpu:gloo,cuda:nccl + device_id"]


def groups_record(device: str, methods: list[str], backend: str) -> dict:
    """What 03_process_groups.py hands back for a 2-rank job (the parts the check reads);
    a fourth group named "cpu:gloo" has that backend alone, as the script names it."""
    return {
        "device": device,
        "init": {
            m: {"backend": "cpu:gloo" if m == "cpu:gloo" else backend, "sum": 3} for m in methods
        },
    }


def check_init_methods(groups: dict, monkeypatch, gpus: int) -> None:
    monkeypatch.setattr(ddp_course.runtime, "gpu_count", lambda: gpus)
    exec(
        notebook_cell("# What the script ran follows the device plan"),
        {"runtime": runtime, "groups": groups},
    )


@pytest.mark.parametrize(
    ("gpus", "record"),
    [
        (0, groups_record("cpu", FOUR_CPU, "cpu:gloo")),
        # 2 ranks, 1 GPU: the job falls back to CPU; the script names gloo.
        (1, groups_record("cpu", FOUR_CPU, "cpu:gloo,cuda:gloo")),
        # One GPU per rank: nccl, and the per-device forms with device_id as the fourth.
        (2, groups_record("cuda:0", FOUR_GPU, "cuda:nccl")),
        (4, groups_record("cuda:0", FOUR_GPU, "cpu:gloo,cuda:nccl")),
    ],
    ids=lambda v: str(v) if isinstance(v, int) else v["device"],
)
def test_init_method_check_follows_the_device_plan(gpus, record, monkeypatch):
    check_init_methods(record, monkeypatch, gpus)


@pytest.mark.parametrize(
    ("gpus", "record"),
    [
        (2, groups_record("cuda:0", THREE, "cuda:nccl")),  # the fourth form is missing
        (0, groups_record("cpu", THREE, "cpu:gloo")),  # the fourth group is missing
        (0, groups_record("cpu", FOUR_GPU, "cpu:gloo")),  # a form that needs GPUs, without
        (2, groups_record("cuda:0", FOUR_CPU, "cuda:nccl")),  # CPU's form with a GPU each
        (2, groups_record("cpu", FOUR_CPU, "cpu:gloo")),  # ran on CPU against the plan
        (2, groups_record("cuda:0", FOUR_GPU, "cpu:gloo")),  # gloo moved CUDA tensors
    ],
)
def test_init_method_check_fails_when_the_run_does_not_match(gpus, record, monkeypatch):
    with pytest.raises(AssertionError):
        check_init_methods(record, monkeypatch, gpus)


# --- notebook 03's deadlock check, with gloo's and nccl's words ------------------------

GLOO_LOG = (
    "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
    "Timed out waiting 3000ms for recv operation to complete\n"
)
NCCL_LOG = (
    "[rank0]:[E1123 10:00:03.000000000 ProcessGroupNCCL.cpp:685] [Rank 0] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=1, OpType=RECV, NumelIn=1, NumelOut=1, "
    "Timeout(ms)=3000) ran for 3003 milliseconds before timing out.\n"
)
PEER_LOG = "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:12345\n"


def check_deadlock(logs: dict[int, str]) -> dict[int, str]:
    error = launch.LaunchError("03_collectives.py failed on rank 0", 0, 1, logs)
    namespace = {"launch": launch, "deadlock_error": error}
    exec(notebook_cell("# Every rank waits in recv"), namespace)
    return namespace["timed_out"]


@pytest.mark.parametrize("log", [GLOO_LOG, NCCL_LOG], ids=["gloo", "nccl"])
def test_deadlock_check_reads_either_backends_timeout(log):
    timed_out = check_deadlock({0: "starting\n" + log, 1: PEER_LOG})
    assert list(timed_out) == [0] and "3000" in timed_out[0]


def test_deadlock_check_fails_without_a_timeout():
    with pytest.raises(AssertionError, match="timeout"):
        check_deadlock({0: PEER_LOG, 1: PEER_LOG})


# --- notebook 03's exercise 2: every rank sends first, on gloo whatever the GPUs --------

SEND_LOG = (
    "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:133] "
    "Timed out waiting 5000ms for send operation to complete\n"
)


def test_send_first_exercise_runs_on_gloo_with_gpus(root, tmp_path, monkeypatch):
    # The exercise teaches a blocking send, whose outcome on nccl the code does not decide:
    # on a machine with GPUs for both ranks its job must still run on the CPU with gloo.
    monkeypatch.setattr(ddp_course.runtime, "gpu_count", lambda: 2)
    monkeypatch.delenv(runtime.DEVICE_ENV, raising=False)
    monkeypatch.chdir(root / "notebooks")  # the cell reads ../scripts/03_collectives.py
    planned = []

    def fake_torchrun(script, args=(), nproc=2, env=None, gpus=None, **kwargs):
        env, _ = launch.planned_env(env, nproc, gpus)
        planned.append(env[runtime.DEVICE_ENV])
        raise launch.LaunchError(f"{script.name} failed on rank 0", 0, 1, {0: SEND_LOG})

    monkeypatch.setattr(launch, "torchrun", fake_torchrun)
    namespace = {
        "BUILD": tmp_path,
        "pathlib": pathlib,
        "runtime": runtime,
        "GPUS": 2,
        "launch": launch,
    }
    exec(notebook_cell("exercise_copy = BUILD"), namespace)
    exec(notebook_cell("assert not isinstance(send_first_error"), namespace)
    assert planned == ["cpu"]
    assert (
        "dist.send(mine, right)  # every rank sends first"
        in (tmp_path / "03_collectives_exercise.py").read_text()
    )
