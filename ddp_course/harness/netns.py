"""Two "hosts" on one machine: network namespaces joined by a veth pair.

A network namespace has its own interfaces, addresses and ports; a veth pair
is a virtual cable whose two ends can live in two namespaces. Processes
started with ``ip netns exec NAME ...`` see only their namespace's network,
so two torchrun agents in two namespaces talk over the veth exactly as two
hosts talk over an Ethernet link (see ``man ip-netns`` and ``man veth``).

Needs root (or CAP_NET_ADMIN) and the ``ip`` command (iproute2).
:func:`unavailable` says why not, for a test or a notebook cell to skip
with the reason; :func:`veth_hosts` creates the namespaces and removes them
on the way out, also when the body raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Iterator

__all__ = [
    "Host",
    "interface_bytes",
    "limit_rate",
    "list_namespaces",
    "unavailable",
    "veth_hosts",
]


@dataclasses.dataclass(frozen=True)
class Host:
    """One end of the veth pair, in its own namespace.

    Attributes:
        netns: the namespace's name (``ip netns exec NETNS ...``).
        ifname: the veth interface's name inside it (``GLOO_SOCKET_IFNAME``).
        addr: its IPv4 address, e.g. ``"10.77.3.1"``.
    """

    netns: str
    ifname: str
    addr: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def list_namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows (``[]`` without ``ip``)."""
    if shutil.which("ip") is None:
        return []
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or ``None`` when they can.

    Tries to create and delete a namespace, so the answer is measured, not
    guessed from the user id.
    """
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed: apt-get install iproute2"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root or skip this part"
    name = f"ddpc_probe_{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@contextlib.contextmanager
def veth_hosts(tag: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair, each end with an address; removed afterwards.

    Names carry ``tag`` (default: this process id) so that two jobs on one
    machine do not collide; the subnet is ``10.77.<tag mod 250>.0/24``,
    addresses ``.1`` and ``.2``. Each namespace's loopback is up too.

    Yields:
        ``(host0, host1)``, :class:`Host` objects.

    Raises:
        RuntimeError: namespaces are not available (the reason of
            :func:`unavailable`) or an ``ip`` command failed (its message).
    """
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    tag = tag or str(os.getpid())
    subnet = int.from_bytes(tag.encode(), "little") % 250 if not tag.isdigit() else int(tag) % 250
    hosts = tuple(
        Host(f"ddpc{tag}_{i}", f"veth{tag}{i}"[-15:], f"10.77.{subnet}.{i + 1}") for i in (0, 1)
    )
    created: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
            created.append(host.netns)
        _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        for host in hosts:
            _ip("link", "set", host.ifname, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts  # type: ignore[misc]
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{' '.join(exc.cmd)} failed: {exc.stderr.strip()}") from exc
    finally:
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for name in created:
            _ip("netns", "del", name, check=False)


def interface_bytes(host: Host) -> dict[str, int]:
    """Bytes sent and received so far by ``host``'s veth interface.

    Returns:
        ``{"tx": bytes sent, "rx": bytes received}``, from the kernel's
        counters (``ip -s -j link show``).
    """
    out = _ip("-n", host.netns, "-s", "-j", "link", "show", "dev", host.ifname).stdout
    stats = json.loads(out)[0]["stats64"]
    return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}


def limit_rate(host: Host, mbit: float, burst_kb: int = 64, latency_ms: int = 100) -> None:
    """Let ``host``'s veth send at most ``mbit`` megabits per second (a slow link).

    A token-bucket filter on the interface's way out (``tc qdisc replace ... tbf``,
    ``man tc-tbf``): bursts of up to ``burst_kb`` kilobytes go at once, the rest at
    the rate, and a packet that would wait more than ``latency_ms`` in the queue is
    dropped (TCP sends it again). Limit both hosts for a link slow both ways; the
    limit goes with the namespace. Adding delay needs ``netem`` (``man tc-netem``),
    a kernel module some machines lack; a rate limit alone already makes the bytes
    of each all-reduce cost time.

    Args:
        host: one end of :func:`veth_hosts`.
        mbit: the rate, megabits per second, > 0.
        burst_kb: the bucket's size in kilobytes.
        latency_ms: the longest a packet may queue, in milliseconds.

    Raises:
        ValueError: ``mbit`` is not positive.
        RuntimeError: ``tc`` is missing or refused (its message).
    """
    if mbit <= 0:
        raise ValueError(f"the rate must be positive, not {mbit} Mbit/s")
    if shutil.which("tc") is None:
        raise RuntimeError("tc (iproute2) is not installed: apt-get install iproute2")
    cmd = ["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", host.ifname]
    cmd += ["root", "tbf", "rate", f"{mbit}mbit", "burst", f"{burst_kb}kb"]
    cmd += ["latency", f"{latency_ms}ms"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
