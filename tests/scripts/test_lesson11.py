"""scripts/11_train.py as plain processes: a run killed mid-epoch (SIGKILL) and
resumed from a mid-epoch snapshot ends with the uninterrupted run's parameters.
The notebook runs the torchrun cases (a restart at an epoch boundary). Also: the batch
script and the printed multi-node commands carry what a job on real nodes needs."""

import re
import shlex
import socket
import subprocess

import psutil
import pytest

from ddp_course.harness import launch, multinode


def test_resume_mid_epoch_equals_the_uninterrupted_run(root, tmp_path):
    script = root / "scripts" / "11_train.py"
    args = ["--epochs", "1", "--max-steps", "30", "--checkpoint-every", "10"]
    one_thread = {"OMP_NUM_THREADS": "1"}  # as torchrun sets it: no oversubscribed cores
    full = launch.python(
        script,
        [*args, "--checkpoint", str(tmp_path / "a.pt")],
        results=True,
        echo=False,
        timeout_s=120,
        env=one_thread,
    ).results
    snap = str(tmp_path / "b.pt")
    with pytest.raises(launch.LaunchError) as killed:
        launch.python(
            script,
            [*args, "--checkpoint", snap, "--die-at-step", "25"],
            echo=False,
            timeout_s=120,
            env=one_thread,
        )
    assert killed.value.returncode == -9  # SIGKILL, no Python exception
    second_attempt = {**one_thread, "TORCHELASTIC_RESTART_COUNT": "1"}
    resumed = launch.python(
        script,
        [*args, "--checkpoint", snap],
        results=True,
        echo=False,
        env=second_attempt,
        timeout_s=120,
    ).results
    assert resumed["resumed_from"] == {"epoch": 0, "step": 20}  # the last snapshot, step 20
    assert resumed["restart_count"] == 1
    assert resumed["parameters_sha256"] == full["parameters_sha256"]
    assert resumed["history"] == full["history"]


# --- the settings a real multi-node job needs, in the batch script and in the printed commands


def _per_node_snippet(root) -> str:
    # The lines srun runs on every node: from `per_node='` to the closing quote.
    lines = (root / "scripts" / "11_train.sbatch").read_text().splitlines()
    start = lines.index("per_node='")
    end = lines.index("'", start)
    return "\n".join(lines[start + 1 : end])


def _run_per_node(root, tmp_path, env, fake_torchrun=True):
    # A stand-in torchrun that prints the variables and arguments it was given.
    bin_dir = tmp_path / ("bin" if fake_torchrun else "bare")
    bin_dir.mkdir(exist_ok=True)
    if fake_torchrun:
        fake = bin_dir / "torchrun"
        fake.write_text(
            '#!/bin/sh\necho "GLOO=$GLOO_SOCKET_IFNAME NCCL=$NCCL_SOCKET_IFNAME"\necho "ARGS $*"\n'
        )
        fake.chmod(0o755)
    return subprocess.run(
        ["bash", "-c", _per_node_snippet(root), "per-node", "--nnodes=2", "train.py"],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_sbatch_gives_every_node_a_fresh_store_and_one_job_id(root):
    text = (root / "scripts" / "11_train.sbatch").read_text()
    lines = [line.strip() for line in text.splitlines()]
    export = lines.index("export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert export < srun  # exported before srun, which hands the environment to every node
    assert '--rdzv-id="$SLURM_JOB_ID"' in text
    assert 'bash -c "$per_node"' in lines[srun]  # every node runs the per-node settings


def test_the_sbatch_names_the_interface_and_the_local_address(root, tmp_path):
    done = _run_per_node(root, tmp_path, {"SOCKET_IFNAME": launch.loopback_interface()})
    assert done.returncode == 0, done.stderr
    lo = launch.loopback_interface()
    assert f"GLOO={lo} NCCL={lo}" in done.stdout
    assert "ARGS --local-addr=127.0.0.1 --nnodes=2 train.py" in done.stdout


def test_the_sbatch_default_interface_is_the_default_route(root, tmp_path):
    done = _run_per_node(root, tmp_path, {})
    assert done.returncode == 0, done.stderr
    routes = subprocess.run(
        ["ip", "-o", "route", "show", "default"], capture_output=True, text=True, check=True
    ).stdout.split()
    ifname = routes[routes.index("dev") + 1] if "dev" in routes else launch.loopback_interface()
    addrs = [a.address for a in psutil.net_if_addrs()[ifname] if a.family == socket.AF_INET]
    assert f"GLOO={ifname} NCCL={ifname}" in done.stdout
    assert re.search(r"ARGS --local-addr=(\S+)", done.stdout)[1] in addrs


def test_the_sbatch_says_what_is_missing_on_a_node(root, tmp_path):
    missing = _run_per_node(root, tmp_path, {"SOCKET_IFNAME": "nosuchif0"})
    assert missing.returncode != 0 and "no IPv4 address on interface nosuchif0" in missing.stderr
    bare = _run_per_node(
        root, tmp_path, {"SOCKET_IFNAME": launch.loopback_interface()}, fake_torchrun=False
    )
    assert bare.returncode == 127
    assert "torchrun" in bare.stderr and "No such file or directory" in bare.stderr


def test_the_printed_node_commands_carry_what_the_agents_run(root, monkeypatch, capsys):
    ran = {}

    def fake_run(nodes, cmds, envs, *rest):
        ran.update(cmds=cmds, envs=envs)

    monkeypatch.setattr(multinode, "_run_nodes", fake_run)
    nodes = [multinode.Node(1, i, f"10.9.9.{i + 1}", f"ns{i}", f"veth{i}") for i in range(2)]
    multinode.torchrun_nodes(
        root / "scripts" / "11_train.py", ["--epochs", "1"], nodes, env={"OMP_NUM_THREADS": "1"}
    )
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[node")]
    assert len(printed) == 2
    for i, (line, cmd, env) in enumerate(zip(printed, ran["cmds"], ran["envs"])):
        shown = shlex.split(line.split("$ ", 1)[1])
        rdzv_id = next(a for a in cmd if a.startswith("--rdzv-id="))
        assert rdzv_id in shown and f"--local-addr=10.9.9.{i + 1}" in shown
        assert f"--local-addr=10.9.9.{i + 1}" in cmd
        for name, value in [
            ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
            ("GLOO_SOCKET_IFNAME", f"veth{i}"),
            ("NCCL_SOCKET_IFNAME", f"veth{i}"),
            ("OMP_NUM_THREADS", "1"),
        ]:
            assert f"{name}={value}" in shown and env[name] == value
        assert shown[:5] == ["ip", "netns", "exec", f"ns{i}", "env"]
