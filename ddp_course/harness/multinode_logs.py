"""What the nodes of a :func:`ddp_course.harness.multinode.torchrun_nodes` job wrote, read
back: the global ranks each node's workers got (from the prefix every echoed worker line
carries), every rank's log keyed by global rank from its node's last rendezvous round, and
a failed rendezvous said in words with what to fix.

A node's logs live under ``<logs_root>/node<i>/`` as torchrun's ``--log-dir`` writes them
(``<run id>/attempt_<k>/<local rank>/stdout.log`` and ``stderr.log``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import failures

if TYPE_CHECKING:
    from .multinode import Node

#: The prefix of every worker line an agent echoes (torchrun's
#: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``): local rank, then global rank.
LINE_PREFIX_TEMPLATE = "[${role_name}${local_rank}|${rank}]:"
_LINE_PREFIX = re.compile(r"^\[[A-Za-z_]*?(\d+)\|(\d+)\]:", re.MULTILINE)
_RDZV_FAILED = ("RendezvousConnectionError", "RendezvousTimeoutError", "RendezvousClosedError")


def global_ranks(agent_output: str, nproc: int) -> list[int] | None:
    """The global ranks of a node's ``nproc`` workers, read from its agent's output; None
    when no worker line names them.

    The last line of local rank 0 names its global rank; torchelastic gives a node's
    workers consecutive global ranks, in local-rank order."""
    found = [(int(lr), int(gr)) for lr, gr in _LINE_PREFIX.findall(agent_output)]
    first = [gr - lr for lr, gr in found]
    if not first:
        return None
    return list(range(first[-1], first[-1] + nproc))


def last_attempt_logs(log_dir: pathlib.Path) -> dict[int, str]:
    """``{local rank: stdout + stderr}`` of one node's newest attempt folder under ``log_dir``
    (``{}`` before any); only that attempt, since a rank's global rank can change from one
    rendezvous round to the next."""
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return {}
    logs = {}
    for rank_dir in sorted(attempts[-1].iterdir()):
        if rank_dir.name.isdigit():
            logs[int(rank_dir.name)] = "".join(
                (rank_dir / n).read_text(errors="replace")
                for n in ("stdout.log", "stderr.log")
                if (rank_dir / n).exists()
            )
    return logs


def explain(i: int, output: str, endpoint: str) -> str:
    """What failed agent ``i``'s own output says went wrong, in words, with the fix; ``""``
    when it shows no rendezvous error (``RendezvousConnectionError``, ``...TimeoutError``,
    ``...ClosedError``) at ``endpoint`` (``HOST:PORT``)."""
    if any(name in output for name in _RDZV_FAILED):
        return (
            f"node {i} could not complete the rendezvous at {endpoint}: nothing answered "
            "there, or not every node joined in time. Check that every node uses the "
            "same --rdzv-endpoint (the address and port of the first node, reachable "
            "from every node), the same --rdzv-id and the same --nnodes, and that the "
            "first node was started."
        )
    return ""


def node_logs(logs_root: pathlib.Path, n: int) -> dict[int, dict[int, str]]:
    """``{node index: {local rank: text}}`` of ``n`` nodes' log folders under ``logs_root``,
    every attempt (:func:`ddp_course.harness.failures.read_rank_logs`)."""
    return {i: failures.read_rank_logs(logs_root / f"node{i}") for i in range(n)}


def by_global_rank(
    node_logs: Mapping[int, Mapping[int, str]],
    running: Mapping[int, tuple[subprocess.Popen, Any, list[str]]],
    nodes: Sequence[Node],
    logs_root: pathlib.Path | None = None,
) -> dict[int, str]:
    """Per-rank logs keyed by global rank, from each node's last rendezvous round
    (node index x nproc + local rank where a node's ranks are unknown).

    Args:
        node_logs: :func:`node_logs` of the job.
        running: ``{node index: (agent process, reader thread, agent output lines)}`` of
            the nodes that started; the lines give the global ranks (:func:`global_ranks`).
        nodes: the job's nodes (their ``nproc``).
        logs_root: the job's log folder; given, each node's newest attempt folder is read
            instead of ``node_logs``.
    """
    logs: dict[int, str] = {}
    for i, local in node_logs.items():
        nproc = nodes[i].nproc
        ranks = global_ranks("".join(running[i][2]), nproc) if i in running else None
        ranks = ranks or list(range(i * nproc, (i + 1) * nproc))
        last = last_attempt_logs(logs_root / f"node{i}") if logs_root is not None else local
        for local_rank, text in (last or local).items():
            if local_rank < len(ranks):
                logs[ranks[local_rank]] = text
    return logs
