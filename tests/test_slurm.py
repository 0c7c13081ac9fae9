"""scripts/11_train.sbatch on a real (one-node) Slurm: ddp_course.slurm.LocalSlurm.

The cluster needs root and Debian's slurm-wlm and munge (installed with apt-get
when missing); where it cannot come up the tests skip with the reason. Every
wait has a timeout, and the cluster's daemons are stopped on the way out.
Run alone with ``make slurm-test``.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

from ddp_course.slurm import LocalSlurm, SlurmJobError, SlurmUnavailable

REPO = pathlib.Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "11_train.sbatch"


def _venv_path() -> str:
    # sbatch hands the job this environment: the course's python and torchrun first.
    return os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ["PATH"]])


@pytest.fixture(scope="module")
def cluster():
    try:
        with LocalSlurm() as slurm:
            yield slurm
    except SlurmUnavailable as exc:
        pytest.skip(f"no local Slurm: {exc}")
    # After the context: no daemon or job step of this cluster runs and its files are gone.
    assert slurm.leftover_processes() == []
    assert not slurm.root.exists()


def test_sbatch_trains_on_slurm_and_a_requeued_job_resumes(cluster, tmp_path):
    env = {"PATH": _venv_path(), "NPROC_PER_NODE": "2", "SNAPSHOT_DIR": str(tmp_path)}
    results = tmp_path / "r.json"
    job = cluster.sbatch(SBATCH, ["--epochs", "1", "--results", str(results)], env=env,
                         options=["--nodes=1"], cwd=REPO)  # fmt: skip
    first = cluster.wait(job, timeout_s=120)
    run = json.loads(results.read_text())
    # Two ranks on the one node, as torchrun under srun numbered them.
    assert run["world_size"] == 2
    assert [(r["rank"], r["local_rank"], r["group_rank"]) for r in run["ranks"]] == [
        (0, 0, 0), (1, 1, 0)
    ]  # fmt: skip
    assert {r["world_size"] for r in run["ranks"]} == {2}
    assert run["backend"] == "gloo"  # no GPU allocated: the CPU rule
    assert run["epochs_done"] == 1 and run["resumed_from"] is None
    assert run["test_accuracy"] > 0.5  # trained: ten classes guess at 0.1
    assert "Slurm restart 0: 1 node(s)" in first.output
    snapshot = tmp_path / f"job-{job}.pt"
    assert snapshot.exists()  # named by the job id, on the folder given as shared storage

    # Requeue (what Slurm does after a node failure): same job id, so the same snapshot.
    cluster.requeue(job)
    second = cluster.wait(job, timeout_s=120)
    again = json.loads(results.read_text())
    assert second.restarts == 1
    assert again["resumed_from"] == {"epoch": 1, "step": 0}
    assert again["parameters_sha256"] == run["parameters_sha256"]  # the snapshot's model
    # --open-mode=append: both runs in one output file.
    assert "Slurm restart 0:" in second.output and "Slurm restart 1:" in second.output


def test_a_job_without_the_course_environment_fails_with_its_output(cluster, tmp_path):
    # The job gets the submitter's environment; without the course's .venv on PATH there
    # is no torchrun on the node: the job fails and wait() shows why.
    env = {"PATH": "/usr/bin:/bin", "SNAPSHOT_DIR": str(tmp_path)}
    job = cluster.sbatch(SBATCH, ["--epochs", "1"], env=env, options=["--nodes=1"], cwd=REPO)
    with pytest.raises(SlurmJobError) as info:
        cluster.wait(job, timeout_s=60)
    assert info.value.state == "FAILED" and info.value.job_id == job
    assert "torchrun" in info.value.output and "No such file or directory" in info.value.output
    assert "torchrun" in str(info.value)  # the end of the output is in the message
