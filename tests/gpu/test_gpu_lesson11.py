"""Lesson 11 on a GPU machine: simulated nodes run on the CPU with gloo and say why.

Every simulated node of ``multinode.torchrun_nodes`` runs on this one machine and would
map its local rank 0 to ``cuda:0``; NCCL refuses two ranks of one job on one GPU
("Duplicate GPU detected"), so the launcher runs the nodes on the CPU with gloo and prints
one line with the reason. Notebook 11's single-node reference runs on the CPU too, so its
parameters' SHA-256 is compared on the same device and backend. A few seconds each.
"""

import pytest
from gpu_support import keep, needs_gpu

from ddp_course import runtime
from ddp_course.harness import launch, multinode

pytestmark = pytest.mark.serial

# One epoch of 3 steps per rank; one thread per rank, as torchrun gives 2 ranks on one node.
ARGS = ["--epochs", "1", "--max-steps", "3"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _two_nodes(root, tmp_path):
    # Two nodes of one rank each on loopback, no network namespace.
    return multinode.torchrun_nodes(
        root / "scripts" / "11_train.py",
        [*ARGS, "--checkpoint", str(tmp_path / "nodes.pt")],
        [multinode.Node(1, i) for i in range(2)],
        results=True,
        echo=True,
        timeout_s=120,
        env=ONE_THREAD,
    )


@needs_gpu
def test_simulated_nodes_run_on_cpu_with_gloo_and_say_why(root, tmp_path, capsys):
    job = _two_nodes(root, tmp_path)
    said = [
        line
        for line in capsys.readouterr().out.splitlines()
        if multinode.SIMULATED_NODES_REASON in line
    ]
    r = job.results
    keep("11_train_two_nodes", r)
    assert len(said) == 1 and "running on CPU with gloo" in said[0]
    assert [(p["device"], p["backend"]) for p in r["ranks"]] == [("cpu", "gloo")] * 2
    assert (r["backend"], r["world_size"]) == ("gloo", 2)


@needs_gpu
def test_the_notebooks_cpu_reference_matches_the_simulated_nodes(root, tmp_path):
    # Notebook 11's reference: 2 ranks on one node, on the CPU as the nodes are.
    reference = launch.torchrun(
        root / "scripts" / "11_train.py",
        [*ARGS, "--checkpoint", str(tmp_path / "ref.pt")],
        nproc=2,
        results=True,
        echo=False,
        timeout_s=120,
        env={runtime.DEVICE_ENV: multinode.SIMULATED_NODES_DEVICE},
    ).results
    nodes = _two_nodes(root, tmp_path).results
    assert reference["backend"] == "gloo"
    assert nodes["parameters_sha256"] == reference["parameters_sha256"]
