"""Several ``torchrun`` agents as the nodes of one job, on one machine.

On a cluster every node runs the same command with its own ``--node-rank``,
its own address and the name of the interface between the nodes (here ``eth1``;
without it gloo and nccl use the address the hostname resolves to, 127.0.1.1 on
many VMs, and the job hangs), the same ``--rdzv-id``, and a fresh store per
rendezvous round (or a restart on several nodes can hang)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=10.0.0.1:29400 --rdzv-id=job42 --local-addr=10.0.0.1 \\
        script.py                                                     # on host 0
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=10.0.0.1:29400 --rdzv-id=job42 --local-addr=10.0.0.2 \\
        script.py                                                     # on host 1

:func:`torchrun_nodes` starts those agents here, each with its own log
folder, optionally each in a network namespace of its own
(:mod:`ddp_course.harness.netns`), and judges the job as :func:`ddp_course.harness.launch.torchrun`
does: a timeout kills every process of every node and names where each rank
was stuck; a failure raises :class:`~ddp_course.harness.launch.LaunchError` naming the
rank and the node; rendezvous problems (wrong endpoint, one node missing)
are said in words with what to fix (what the nodes wrote is read back by
:mod:`ddp_course.harness.multinode_logs`). See
https://pytorch.org/docs/stable/elastic/run.html for torchrun's flags.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..runtime import DEVICE_ENV
from . import failures, forked_ranks, jobs, launch, multinode_logs
from .multinode_commands import SHOWN_ENV, agent_cmd, shown_command

__all__ = [
    "SIMULATED_NODES_DEVICE",
    "SIMULATED_NODES_REASON",
    "MultiNodeResult",
    "Node",
    "torchrun_nodes",
]

#: The device type (``DDP_COURSE_DEVICE``) of every worker of :func:`torchrun_nodes`,
#: whatever GPUs this machine has; the backend is then gloo.
SIMULATED_NODES_DEVICE = "cpu"

#: Why :func:`torchrun_nodes` runs on :data:`SIMULATED_NODES_DEVICE`, one sentence for a
#: learner. Every node's local rank 0 would take ``cuda:0``, and NCCL refuses a communicator
#: with two ranks on one device ("Duplicate GPU detected"): its host hash, built from the
#: hostname and the boot id, is the same in every network namespace. Between ranks of one host
#: NCCL moves data over P2P or shared memory, so the link between the nodes that lesson 11
#: counts would carry no gradients; gloo always uses its TCP sockets.
SIMULATED_NODES_REASON = (
    "the nodes share this machine's GPUs and NCCL refuses two ranks of one job on one GPU, "
    "and only gloo's sockets send the gradients over the link between the nodes "
    "(nccl inside one machine bypasses it); nccl across nodes needs real nodes"
)


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of a job: one torchrun agent and its workers.

    Attributes:
        nproc: workers (ranks) on this node, ``--nproc-per-node``.
        node_rank: ``--node-rank``; c10d's rendezvous assigns the group
            rank itself and uses this only as a hint.
        addr: this node's address (``--local-addr``), where its workers'
            store and gloo listen.
        netns: run the agent inside this network namespace (``ip netns exec``).
        ifname: the interface gloo uses on this node (``GLOO_SOCKET_IFNAME``).
        start_when: start this agent only once the job's streamed output
            contains this text (a node joining a running job).
        torchrun_args: more torchrun flags for this node only.
    """

    nproc: int = 1
    node_rank: int = 0
    addr: str = "127.0.0.1"
    netns: str | None = None
    ifname: str | None = None
    start_when: str | None = None
    torchrun_args: tuple[str, ...] = ()


@dataclasses.dataclass
class MultiNodeResult:
    """A finished, successful multi-node job.

    Attributes:
        logs: every rank's output ``{global rank: text}`` from the last attempt
            that rank took part in.
        node_logs: ``{node index: {local rank: text}}``, every attempt.
        global_ranks: ``{node index: [global rank of local rank 0, 1, ...]}``
            as the rendezvous assigned them in the last round.
        output: ``{node index: the agent's own output}``.
        results: the parsed JSON results file, or ``None``.
        wall_s: seconds from the first start to the last exit.
    """

    logs: dict[int, str]
    node_logs: dict[int, dict[int, str]]
    global_ranks: dict[int, list[int]]
    output: dict[int, str]
    results: Any
    wall_s: float


def torchrun_nodes(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    nodes: Sequence[Node] | None = None,
    nnodes: str | None = None,
    endpoint: str | None = None,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    results: bool = False,
    echo: bool = True,
    extra_torchrun_args: Sequence[str] = (),
    log_dir: str | os.PathLike | None = None,
    grace_s: float = 10.0,
    rdzv_conf: Mapping[str, Any] | None = None,
    silent_s: float | None = None,
) -> MultiNodeResult:
    """Run one job as several torchrun agents (nodes) on this machine and wait for it.

    Prints the command each node runs, with the environment variables a node
    needs on a real cluster too (``[node 1] $ TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    torchrun --nnodes=2 ... --rdzv-id=... --local-addr=...``) and streams
    node 0's rank 0 output. The job always runs on CPU with gloo
    (:data:`SIMULATED_NODES_DEVICE`, why in :data:`SIMULATED_NODES_REASON`),
    and with ``echo`` says so in one line first.

    Args:
        script: path of the Python script.
        args: the script's own arguments (the same on every node).
        nodes: one :class:`Node` per agent; default two nodes of one rank on
            loopback.
        nnodes: ``--nnodes``, e.g. ``"2"`` or ``"1:2"`` (elastic); default the
            number of nodes.
        endpoint: ``HOST:PORT`` of the c10d rendezvous; default a free port on
            the first node's address.
        timeout_s: wall-clock limit in seconds for the whole job.
        env: extra environment variables for every agent and rank of every node;
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` defaults to ``1`` (a fresh
            store for the workers at each rendezvous round, see the code).
            ``DDP_COURSE_DEVICE`` is always ``"cpu"``; giving it here is allowed
            only with that value. Each node's ranks are forked from its agent
            (:mod:`.forked_ranks`) unless ``DDP_COURSE_FORK_RANKS=0``.
        results: pass ``--results <file>`` (one file, shared) and return its JSON.
        echo: print the device line and node 0's rank 0 output live.
        extra_torchrun_args: more torchrun flags for every node (e.g.
            ``["--max-restarts=1", "--rdzv-conf=join_timeout=5"]``).
        log_dir: keep the per-node logs here (``node0/``, ``node1/``, ...);
            default a temporary folder, removed afterwards.
        grace_s: seconds the other agents get to stop by themselves after one
            failed, before they are killed.
        rdzv_conf: torchrun's ``--rdzv-conf`` for every node, e.g.
            ``{"join_timeout": 5}`` (seconds to wait for all nodes) or
            ``{"last_call_timeout": 1}`` (seconds an elastic job waits for more
            nodes once it has the minimum). A node whose address is the
            endpoint's host but not its hostname's (a namespace, a second
            network card) also gets ``is_host=true``: torch guesses who hosts
            the rendezvous store from the hostname and would find no host.
        silent_s: stop the job as hung, as ``timeout_s`` does, once every node
            has started and no agent printed a line (its node's rank 0
            included) for this many seconds; default None, only ``timeout_s``.

    Returns:
        :class:`MultiNodeResult`.

    Raises:
        FileNotFoundError: ``script`` does not exist.
        ValueError: no nodes, a node with ``nproc`` < 1, or ``env`` asks for a
            ``DDP_COURSE_DEVICE`` other than ``"cpu"`` (the message says why).
        LaunchTimeout: the job ran past ``timeout_s`` or was silent for
            ``silent_s``; every process of every node was killed; the message
            says which nodes never got workers (a rendezvous that did not
            complete) and where each rank was.
        LaunchError: an agent failed; the message names the node and the
            rank and shows the traceback, or says what to fix in the
            rendezvous settings.
    """
    path = jobs.check_script(script)
    nodes = list(nodes) if nodes is not None else [Node(node_rank=0), Node(node_rank=1)]
    if not nodes:
        raise ValueError("give at least one Node")
    for node in nodes:
        if node.nproc < 1:
            raise ValueError(f"nproc must be at least 1, not {node.nproc}")
    nnodes = nnodes or str(len(nodes))
    if endpoint is None:
        # A port free here; a fresh namespace has every port free, and its
        # address cannot be bound from outside it.
        port = launch.free_port("127.0.0.1" if nodes[0].netns else nodes[0].addr)
        endpoint = f"{nodes[0].addr}:{port}"
    env = dict(env or {})
    given_env = list(env)  # shown in the printed commands, with SHOWN_ENV
    asked = env.get(DEVICE_ENV, SIMULATED_NODES_DEVICE)
    if asked != SIMULATED_NODES_DEVICE:
        raise ValueError(
            f"{DEVICE_ENV}={asked!r}: simulated nodes run on {SIMULATED_NODES_DEVICE!r} "
            f"only: {SIMULATED_NODES_REASON}"
        )
    # Set even when this process's environment says cuda: it would reach every worker.
    env[DEVICE_ENV] = SIMULATED_NODES_DEVICE
    if echo:
        print(
            f"{len(nodes)} simulated nodes: running on CPU with gloo because "
            f"{SIMULATED_NODES_REASON}",
            flush=True,
        )
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", multinode_logs.LINE_PREFIX_TEMPLATE)
    # A fresh store for the workers at every rendezvous round, instead of the
    # agents' shared one. With the shared store, keys of a dead round stay
    # readable; runtime.distributed() keys them by TORCHELASTIC_RESTART_COUNT,
    # but on several nodes the counts can differ (an agent whose workers did not
    # fail restarts them uncounted when another node waits at the rendezvous:
    # torch.distributed.elastic.agent.server.api, _invoke_run), and a node that
    # joins a running job waits for a MASTER_ADDR that the first node never
    # publishes for the new round (torch 2.13). Both hung here.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with tempfile.TemporaryDirectory(prefix="ddp_course_") as tmp:
        logs_root = pathlib.Path(log_dir) if log_dir is not None else pathlib.Path(tmp, "logs")
        results_path = pathlib.Path(tmp, "results.json") if results else None
        run_id = f"ddp_course_{os.getpid()}_{time.monotonic_ns()}"
        cmds, envs = [], []
        for i, node in enumerate(nodes):
            agent_tmp = pathlib.Path(tmp, f"agent{i}")
            agent_tmp.mkdir()
            job_args = [*args, *(["--results", str(results_path)] if results_path else [])]
            cmds.append(
                agent_cmd(
                    node,
                    nnodes,
                    endpoint,
                    run_id,
                    agent_tmp,
                    logs_root / f"node{i}",
                    extra_torchrun_args,
                    path,
                    job_args,
                    forked_ranks.enabled(env),
                )
            )
            conf = dict(rdzv_conf or {})
            if node.netns and endpoint.rpartition(":")[0] == node.addr:
                conf.setdefault("is_host", "true")
            conf_args = (
                [f"--rdzv-conf={','.join(f'{k}={v}' for k, v in conf.items())}"] if conf else []
            )
            cmds[-1][cmds[-1].index(str(path.resolve())) : 0] = conf_args
            node_env = dict(env)
            if node.ifname:
                node_env.setdefault("GLOO_SOCKET_IFNAME", node.ifname)
                node_env.setdefault("NCCL_SOCKET_IFNAME", node.ifname)
            envs.append(node_env)
            shown_env = {k: node_env[k] for k in [*given_env, *SHOWN_ENV] if k in node_env}
            shown = shown_command(
                node,
                nnodes,
                endpoint,
                run_id,
                shown_env,
                [*conf_args, *extra_torchrun_args],
                script,
                args,
            )
            print(f"[node {i}] $ {shown}", flush=True)
        return _run_nodes(
            nodes,
            cmds,
            envs,
            path,
            endpoint,
            timeout_s,
            echo,
            grace_s,
            logs_root,
            results_path,
            silent_s,
        )


def _run_nodes(
    nodes: list[Node],
    cmds: list[list[str]],
    envs: list[dict[str, str]],
    script: pathlib.Path,
    endpoint: str,
    timeout_s: float,
    echo: bool,
    grace_s: float,
    logs_root: pathlib.Path,
    results_path: pathlib.Path | None,
    silent_s: float | None = None,
) -> MultiNodeResult:
    start = time.perf_counter()
    deadline = start + timeout_s
    # A hung job prints nothing: the clock restarts at every line and every node start.
    lines_seen, quiet_since, went_silent = -1, start, False
    running: dict[int, tuple[subprocess.Popen, Any, list[str]]] = {}
    codes: dict[int, int] = {}
    first_failure: int | None = None
    failed_at = 0.0

    def output(i: int) -> str:
        return "".join(running[i][2]) if i in running else ""

    try:
        while True:
            for i, node in enumerate(nodes):
                if i in running:
                    continue
                if node.start_when is None or node.start_when in output(0):
                    if node.start_when is not None:
                        print(f"[node {i}] starts now, joining the running job", flush=True)
                    running[i] = jobs.start_job(cmds[i], envs[i], echo and i == 0)
            for i, (proc, _, _) in running.items():
                if i not in codes and proc.poll() is not None:
                    codes[i] = proc.returncode
                    if proc.returncode != 0 and first_failure is None:
                        first_failure, failed_at = i, time.perf_counter()
            if len(codes) == len(nodes):
                break
            now = time.perf_counter()
            if first_failure is not None and now - failed_at > grace_s:
                break
            if now >= deadline:
                raise subprocess.TimeoutExpired(cmds[0], timeout_s)
            seen = sum(len(out) for _, _, out in running.values()) + len(running)
            if seen != lines_seen:
                lines_seen, quiet_since = seen, now
            elif (
                silent_s is not None
                and len(running) == len(nodes)
                and (now - quiet_since >= silent_s)
            ):
                went_silent = True
                raise subprocess.TimeoutExpired(cmds[0], silent_s)
            time.sleep(0.05)
    except subprocess.TimeoutExpired:
        for proc, _, _ in running.values():
            jobs.dump_python_stacks(proc, script)
        _stop_all(running)
        node_logs = multinode_logs.node_logs(logs_root, len(nodes))
        never = [i for i in range(len(nodes)) if not node_logs.get(i)]
        hint = ""
        if never:
            hint = (
                f"\nNode(s) {', '.join(map(str, never))} never started workers: the "
                f"rendezvous at {endpoint} did not complete. Every node must be started, "
                "with the same --nnodes, --rdzv-id and --rdzv-endpoint."
            )
        where = "".join(
            failures.where_stuck(logs, script).replace("\n  rank", f"\n  node {i} local rank")
            for i, logs in sorted(node_logs.items())
        )
        why = (
            f"printed nothing for {silent_s:g} s (silent_s)"
            if went_silent
            else f"ran past its {timeout_s:g} s timeout"
        )
        error = launch.LaunchTimeout(
            f"{script.name} {why} on {len(nodes)} node(s); "
            f"every process of every node was killed.{hint}{where}",
            None,
            -signal.SIGKILL,
            multinode_logs.by_global_rank(node_logs, running, nodes),
        )
        error.agent_output = {i: output(i) for i in range(len(nodes))}  # type: ignore[attr-defined]
        raise error from None
    finally:
        _stop_all(running)
    wall_s = time.perf_counter() - start
    node_logs = multinode_logs.node_logs(logs_root, len(nodes))
    outputs = {i: output(i) for i in range(len(nodes))}
    logs = multinode_logs.by_global_rank(node_logs, running, nodes, logs_root)
    if first_failure is not None or any(codes.get(i, 1) != 0 for i in range(len(nodes))):
        i = first_failure if first_failure is not None else 0
        why = multinode_logs.explain(i, outputs[i], endpoint)
        rank = failures.failing_rank(outputs[i], logs)
        if why:
            message = f"{script.name} failed: {why}\n--- end of node {i}'s agent ---\n" + "\n".join(
                outputs[i].rstrip().splitlines()[-6:]
            )
        else:
            where = f"rank {rank}" if rank is not None else "an unknown rank"
            detail = failures.tail_traceback(
                logs.get(rank, outputs[i]) if rank is not None else outputs[i]
            )
            message = (
                f"{script.name} failed on {where} (node {i}, exit code {codes.get(i)}).\n"
                f"--- end of {where}'s output ---\n{detail}"
            )
        error = launch.LaunchError(message, rank, codes.get(i, -1), logs)
        error.agent_output = outputs  # type: ignore[attr-defined]
        raise error
    data = None
    if results_path is not None:
        if not results_path.exists():
            raise launch.LaunchError(
                f"{script.name} exited cleanly but wrote no --results file", None, 0, logs
            )
        data = json.loads(results_path.read_text())
    ranks = {
        i: multinode_logs.global_ranks(outputs[i], nodes[i].nproc) or [] for i in range(len(nodes))
    }
    print(f"{script.name} finished on {len(nodes)} nodes in {wall_s:.1f} s", flush=True)
    return MultiNodeResult(logs, node_logs, ranks, outputs, data, wall_s)


def _stop_all(running: Mapping[int, tuple[subprocess.Popen, Any, list[str]]]) -> None:
    # All at once: an agent stuck in a store call ignores SIGTERM for kill_job's whole
    # grace period, and one at a time the waits would add up, node after node.
    stoppers = [
        threading.Thread(target=jobs.kill_job, args=(proc,))
        for proc, _, _ in running.values()
        if proc.poll() is None
    ]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()
    for _, reader, _ in running.values():
        reader.join(timeout=5)
