"""The commands of :func:`ddp_course.harness.multinode.torchrun_nodes`: what each
simulated node's agent runs, and the command a learner would type on that node, built
from the same torchrun flags (https://pytorch.org/docs/stable/elastic/run.html).
"""

from __future__ import annotations

import os
import pathlib
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from . import jobs
from .loopback import agent_command

if TYPE_CHECKING:
    from .multinode import Node

__all__ = ["SHOWN_ENV", "agent_cmd", "shown_command"]


def _node_flags(node: Node, nnodes: str, endpoint: str, run_id: str) -> list[str]:
    # torchrun's flags for one node of a multi-node job: what the agent gets and what
    # the learner is shown alike.
    return [
        f"--nnodes={nnodes}",
        f"--node-rank={node.node_rank}",
        f"--nproc-per-node={node.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--local-addr={node.addr}",
    ]


def agent_cmd(
    node: Node,
    nnodes: str,
    endpoint: str,
    run_id: str,
    agent_tmp: pathlib.Path,
    log_dir: pathlib.Path,
    extra: Sequence[str],
    script: pathlib.Path,
    args: Sequence[str],
    fork_ranks: bool,
) -> list[str]:
    """What the launcher runs for ``node``: the course's torchrun agent
    (:func:`.loopback.agent_command`) with the node's flags, its log folder, then the
    script; inside the node's network namespace when it has one."""
    cmd = [
        *agent_command(agent_tmp, fork_ranks),
        *_node_flags(node, nnodes, endpoint, run_id),
        f"--log-dir={log_dir}",
        "--tee=3",
        "--local-ranks-filter=0",
        *extra,
        *node.torchrun_args,
        str(script.resolve()),
        *args,
    ]
    if node.netns is not None:
        cmd = ["ip", "netns", "exec", node.netns, *cmd]
    return cmd


#: What a node needs in its environment on a real cluster too: shown in front of
#: the command each node runs (the launcher's own variables are not).
SHOWN_ENV = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def shown_command(
    node: Node,
    nnodes: str,
    endpoint: str,
    run_id: str,
    env: Mapping[str, str],
    extra: Sequence[str],
    script: str | os.PathLike,
    args: Sequence[str],
) -> str:
    """The command a learner would type on that node: its environment variables, then
    torchrun with every flag the agent gets (``--rdzv-id`` and ``--local-addr`` too)."""
    assignments = [f"{k}={v}" for k, v in env.items()]
    prefix = ["ip", "netns", "exec", node.netns, "env", *assignments] if node.netns else assignments
    return shlex.join(
        [
            *prefix,
            "torchrun",
            *_node_flags(node, nnodes, endpoint, run_id),
            *extra,
            *node.torchrun_args,
            jobs.shown_path(script),
            *args,
        ]
    )
