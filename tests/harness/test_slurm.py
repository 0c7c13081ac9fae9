"""scripts/11_train.sbatch on a real (one-node) Slurm: ddp_course.harness.slurm.LocalSlurm.

The cluster needs root and Debian's slurm-wlm and munge (installed with apt-get
when missing); where it cannot come up the tests skip with the reason. Every
wait has a timeout, and the cluster's daemons are stopped on the way out.
Run alone with ``make slurm-test``, which also runs notebooks/11_multinode.ipynb:
the job that trains through the batch script, is requeued and resumes to the same
parameters runs there once (section 6 and exercise 6), with every check of it.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time

import psutil
import pytest

from ddp_course.harness import slurm
from ddp_course.harness.ports import free_port
from ddp_course.harness.slurm import DAEMONS, LocalSlurm
from ddp_course.harness.slurm_install import SlurmUnavailable, install_packages, missing_commands
from ddp_course.harness.slurm_jobs import SlurmJobError
from ddp_course.runtime import device_plan

REPO = pathlib.Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "11_train.sbatch"
# The timeout is a backstop: every wait below has its own. The Slurm job uses
# both cores like a notebook does: `make test` runs it in the serial pass.
pytestmark = [pytest.mark.timeout(450), pytest.mark.serial]


@pytest.fixture(scope="module")
def cluster():
    started = time.time()
    try:
        with LocalSlurm() as local:
            yield local
    except SlurmUnavailable as exc:
        pytest.skip(f"no local Slurm: {exc}")
    # After the context: no daemon or job step of this cluster runs and its files are gone.
    assert local.leftover_processes() == []
    assert not local.root.exists()
    late = [
        p
        for p in psutil.process_iter(["name", "pid", "create_time"])
        if p.info["name"] in DAEMONS and p.info["create_time"] >= started
    ]
    # A job step forked while slurmd stopped may still be exiting (seen once): it
    # must be gone within seconds, not left running.
    _, alive = psutil.wait_procs(late, timeout=10)
    assert alive == [], f"Slurm or MUNGE processes left running: {[p.info for p in alive]}"


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


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match="needs root"):
        LocalSlurm().__enter__()


def test_a_failing_apt_get_is_a_clear_error(monkeypatch, tmp_path):
    fake = tmp_path / "apt-get"  # an apt-get that fails as it does without a network
    fake.write_text("#!/bin/sh\necho 'E: Unable to locate package slurm-wlm' >&2\nexit 100\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SlurmUnavailable, match=r"failed \(exit 100\)[\s\S]*Unable to locate"):
        install_packages(timeout_s=10)


def test_a_daemon_that_cannot_start_is_a_clear_error(monkeypatch):
    if os.geteuid() != 0 or missing_commands():
        pytest.skip("needs root and the Slurm packages")
    # The controller's port already taken by someone else: slurmctld cannot listen.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # overlaps slurmctld's 0.0.0.0
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port])  # the controller's port first, then free ones
        monkeypatch.setattr(slurm, "free_port", lambda: next(ports, None) or free_port())
        start = time.monotonic()
        with pytest.raises(SlurmUnavailable, match="slurmctld") as info:
            with LocalSlurm(start_timeout_s=10):
                pass
    assert time.monotonic() - start < 30
    assert "Address already in use" in str(info.value)  # the end of its log says why


def _sbatch_device_rule(gpus: int | None, nproc: int | None) -> tuple[str, int]:
    # The script's own lines, from the GPU count to the export, run by bash.
    lines = SBATCH.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("gpus="))
    end = next(i for i, line in enumerate(lines) if line.startswith("export DDP_COURSE_DEVICE"))
    snippet = "\n".join([*lines[start : end + 1], 'echo "$DDP_COURSE_DEVICE $nproc"'])
    env = {"PATH": os.environ["PATH"]}
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    if nproc is not None:
        env["NPROC_PER_NODE"] = str(nproc)
    out = subprocess.run(
        ["bash", "-euc", snippet], env=env, capture_output=True, text=True, timeout=10, check=True
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.parametrize("gpus", [None, 0, 1, 2, 4])
@pytest.mark.parametrize("nproc", [None, 1, 2, 4])
def test_the_sbatch_device_rule_is_the_course_rule(gpus, nproc):
    device, ranks = _sbatch_device_rule(gpus, nproc)
    expected_ranks = nproc or (gpus or 2)  # default: one rank per GPU, 2 CPU ranks without
    assert ranks == expected_ranks
    assert device == device_plan(expected_ranks, gpus or 0).device_type


@pytest.mark.parametrize(
    ("cpus", "nproc", "preset", "threads"),
    [(None, 2, None, 1), (64, 8, None, 8), (4, 8, None, 1), (64, 8, "3", 3)],
)
def test_the_sbatch_threads_per_rank_share_the_task_cpus(cpus, nproc, preset, threads):
    lines = SBATCH.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("cpus="))
    end = next(i for i, line in enumerate(lines) if line.startswith("export OMP_NUM_THREADS"))
    snippet = "\n".join([f"nproc={nproc}", *lines[start : end + 1], 'echo "$OMP_NUM_THREADS"'])
    env = {"PATH": os.environ["PATH"]}
    if cpus is not None:
        env["SLURM_CPUS_PER_TASK"] = str(cpus)
    if preset is not None:
        env["OMP_NUM_THREADS"] = preset
    out = subprocess.run(
        ["bash", "-euc", snippet], env=env, capture_output=True, text=True, timeout=10, check=True
    ).stdout
    assert int(out) == threads
