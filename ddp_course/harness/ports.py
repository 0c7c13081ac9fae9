"""Ports and interfaces for jobs on one machine: a free port that cannot collide with
a client's source port, the loopback interface, and whether torchrun flags span nodes."""

from __future__ import annotations

import pathlib
import random
import socket
from collections.abc import Sequence

import psutil

__all__ = ["MULTI_NODE_FLAGS", "free_port", "is_multi_node", "loopback_interface"]


def ephemeral_ports() -> range:
    """The ports from which the kernel picks a client's source port: Linux's
    ``/proc/sys/net/ipv4/ip_local_port_range``, elsewhere the IANA range 49152-65535."""
    try:
        low, high = map(
            int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        )
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` and lies outside the ephemeral range.

    A rank that connects to a store before the store's owner listens retries
    with a fresh source port from the ephemeral range each time. If the store's
    port is in that range, one retry can draw the port itself and TCP connects
    the socket to itself ("simultaneous open"): the client then waits forever
    for an answer it sent to itself, and the job hangs. A port below the range
    cannot be drawn, so it is picked at random from ``[10000, low)`` (or from
    the range's top end when it starts too low) and bound once to check it.

    Raises:
        RuntimeError: if no port outside the ephemeral range could be bound.
    """
    ephemeral = ephemeral_ports()
    candidates = list(range(10000, ephemeral.start)) or list(range(ephemeral.stop, 65536))
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(
        f"no free TCP port on {host} outside the ephemeral range "
        f"{ephemeral.start}-{ephemeral.stop - 1}; close some servers or pass a port yourself"
    )


# Flags that make a job span several nodes; the launcher then leaves
# addresses and interfaces to them instead of pinning everything to loopback.
MULTI_NODE_FLAGS = frozenset(
    {
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        "--rdzv-backend",
        "--rdzv_backend",
        "--master-addr",
        "--master_addr",
        "--master-port",
        "--master_port",
        "--node-rank",
        "--node_rank",
        "--local-addr",
        "--local_addr",
    }
)


def loopback_interface() -> str | None:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux,
    ``lo0`` on macOS), or ``None`` if there is none."""
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and address.address.startswith("127."):
                return name
    return None


def is_multi_node(extra_torchrun_args: Sequence[str]) -> bool:
    """Whether torchrun flags make a job span several nodes (a rendezvous endpoint,
    a master address, a node rank or ``--nnodes`` above 1)."""
    for arg in extra_torchrun_args:
        flag, _, value = arg.partition("=")
        if flag in MULTI_NODE_FLAGS or (flag == "--nnodes" and value not in ("1", "1:1")):
            return True
    return False
