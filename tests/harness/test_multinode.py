"""multinode and netns: what notebook 11 does not run (a node that never joins, a
failing rank on another node, namespaces removed after a failure), the device every
simulated node's workers get on a machine with 1, 2 or 4 GPUs, and the restart loop
that checks the store-prefix fix (by hand: DDP_COURSE_RESTART_LOOP=N)."""

import json
import os
import time

import psutil
import pytest

from ddp_course import runtime
from ddp_course.harness import launch, multinode, multinode_logs, netns, restarts


def _alive(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def test_a_node_that_never_joins_times_out_and_says_so(workers):
    # Two nodes announced, one started: the rendezvous cannot complete.
    start = time.perf_counter()
    with pytest.raises(launch.LaunchTimeout) as caught:
        multinode.torchrun_nodes(
            workers / "fail_or_hang.py",
            nodes=[multinode.Node(1, 0)],
            nnodes="2",
            timeout_s=8,
            echo=False,
        )
    assert time.perf_counter() - start < 8 + 20
    message = str(caught.value)
    assert "never started workers" in message and "--rdzv-endpoint" in message
    time.sleep(0.5)
    assert _alive("fail_or_hang.py") == [] and _alive("--rdzv-id=ddp_course_") == []


def test_a_failing_rank_is_named_with_its_node(workers):
    with pytest.raises(launch.LaunchError) as caught:
        multinode.torchrun_nodes(
            workers / "fail_or_hang.py", ["--fail-rank", "1"], timeout_s=120, echo=False
        )
    error = caught.value
    assert not isinstance(error, launch.LaunchTimeout)
    assert error.rank == 1 and "failed on rank 1" in str(error)
    assert "deliberate failure on rank 1" in str(error)
    time.sleep(0.5)
    assert _alive("fail_or_hang.py") == []


def test_global_ranks_come_from_the_agents_line_prefix():
    output = "[default0|2]:hello\n[default1|3]:hi\n"
    assert multinode_logs.global_ranks(output, 2) == [2, 3]
    assert multinode_logs.global_ranks("no worker line\n", 2) is None


def test_attempt_prefix_changes_with_restarts_and_world_size(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    first = restarts.attempt_prefix()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = restarts.attempt_prefix()
    monkeypatch.setenv("WORLD_SIZE", "3")
    grown = restarts.attempt_prefix()
    assert len({first, restarted, grown}) == 3


# --- the device plan of simulated nodes: they share this machine's GPUs


def _planned_envs(monkeypatch, workers, gpus, nodes, env=None, echo=False):
    """The environment each node's agent (and its workers) would get, nothing started."""
    ran = {}

    def fake_run(nodes, cmds, envs, *rest):
        ran.update(envs=envs)

    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    monkeypatch.setattr(multinode, "_run_nodes", fake_run)
    multinode.torchrun_nodes(workers / "fail_or_hang.py", nodes=nodes, env=env, echo=echo)
    return ran["envs"]


NODE_SHAPES = [(1, 1), (2, 2), (1, 2), (4, 4)]


@pytest.mark.parametrize("gpus", [1, 2, 4])
@pytest.mark.parametrize("shape", NODE_SHAPES, ids=["+".join(map(str, s)) for s in NODE_SHAPES])
def test_simulated_nodes_never_put_a_gpu_twice(monkeypatch, workers, gpus, shape):
    # Every node runs on this machine: local rank r of any node would take cuda:r.
    monkeypatch.delenv(runtime.DEVICE_ENV, raising=False)
    nodes = [multinode.Node(n, i) for i, n in enumerate(shape)]
    envs = _planned_envs(monkeypatch, workers, gpus, nodes)
    taken = []  # the physical GPU of every worker that gets one
    for node, env in zip(nodes, envs):
        for local_rank in range(node.nproc):
            device = runtime.device_for_rank(local_rank, gpus, env[runtime.DEVICE_ENV])
            taken += [device.index] if device.type == "cuda" else []
    assert len(taken) == len(set(taken)), f"GPUs {taken} for nodes {shape} on {gpus} GPUs"
    assert [env[runtime.DEVICE_ENV] for env in envs] == [multinode.SIMULATED_NODES_DEVICE] * 2
    assert multinode.SIMULATED_NODES_DEVICE == "cpu"


def test_simulated_nodes_ignore_a_cuda_plan_inherited_from_this_process(monkeypatch, workers):
    monkeypatch.setenv(runtime.DEVICE_ENV, "cuda")
    envs = _planned_envs(monkeypatch, workers, 4, [multinode.Node(1, 0), multinode.Node(1, 1)])
    assert [e[runtime.DEVICE_ENV] for e in envs] == ["cpu", "cpu"]


def test_simulated_nodes_refuse_cuda_and_accept_cpu_from_the_caller(monkeypatch, workers):
    with pytest.raises(ValueError, match="NCCL refuses two ranks of one job on one GPU"):
        _planned_envs(monkeypatch, workers, 2, None, env={runtime.DEVICE_ENV: "cuda"})
    envs = _planned_envs(monkeypatch, workers, 2, None, env={runtime.DEVICE_ENV: "cpu"})
    assert [e[runtime.DEVICE_ENV] for e in envs] == ["cpu", "cpu"]


@pytest.mark.parametrize("echo", [True, False])
def test_simulated_nodes_say_why_they_run_on_cpu_once(monkeypatch, workers, capsys, echo):
    _planned_envs(monkeypatch, workers, 2, None, echo=echo)
    said = [
        line
        for line in capsys.readouterr().out.splitlines()
        if multinode.SIMULATED_NODES_REASON in line
    ]
    expected = "2 simulated nodes: running on CPU with gloo because " + (
        multinode.SIMULATED_NODES_REASON
    )
    assert said == ([expected] if echo else [])


needs_netns = pytest.mark.skipif(
    netns.unavailable() is not None, reason=f"network namespaces: {netns.unavailable()}"
)


@needs_netns
def test_namespaces_are_removed_even_when_the_body_raises():
    with pytest.raises(ValueError, match="inside"):
        with netns.veth_hosts(tag="t1") as hosts:
            names = [h.netns for h in hosts]
            assert set(names) <= set(netns.list_namespaces())
            assert all(netns.interface_bytes(h)["tx"] >= 0 for h in hosts)
            raise ValueError("inside")
    assert not set(names) & set(netns.list_namespaces())


@pytest.mark.skipif(
    "DDP_COURSE_RESTART_LOOP" not in os.environ,
    reason="minutes: run by hand with DDP_COURSE_RESTART_LOOP=N",
)
def test_restart_loop(root, tmp_path):
    """N restarts of a killed worker (two ranks, --max-restarts=1, c10d on
    loopback); each must resume and end with the uninterrupted run's parameters."""
    n = int(os.environ["DDP_COURSE_RESTART_LOOP"])
    script, args = root / "scripts" / "11_train.py", ["--epochs", "2"]
    ref = launch.torchrun(
        script, [*args, "--checkpoint", str(tmp_path / "ref.pt")], results=True, echo=False
    ).results
    outcomes = []
    for i in range(n):
        try:
            r = launch.torchrun(
                script,
                [
                    *args,
                    "--checkpoint",
                    str(tmp_path / f"k{i}.pt"),
                    "--die-at-step",
                    "70",
                    "--die-rank",
                    "1",
                ],
                results=True,
                echo=False,
                timeout_s=240,
                extra_torchrun_args=["--max-restarts=1"],
            ).results
            ok = r["restart_count"] == 1 and r["parameters_sha256"] == ref["parameters_sha256"]
            outcomes.append("ok" if ok else "different parameters")
        except launch.LaunchError as exc:
            outcomes.append(str(exc).splitlines()[0])
    print(json.dumps({"runs": n, "ok": outcomes.count("ok"), "outcomes": outcomes}, indent=1))
    assert outcomes.count("ok") == n
