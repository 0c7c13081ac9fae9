"""A pytest plugin that fails any test or notebook cell during which a process it started
listened on a TCP address other than loopback.

Every store, server and listener a lesson starts on one machine must be reachable from
this machine only: torchrun's agent store, the ``tcp://`` rendezvous, gloo's sockets, side
stores, a Jupyter kernel's ports. A background thread reads the kernel's tables of
listening sockets (``/proc/net/tcp``, ``/proc/net/tcp6``, state ``0A``) every
:data:`PERIOD_S` seconds and maps each socket to the process holding it, among this pytest
process and its descendants (a notebook's kernel and the jobs it launches included).
A listener that lives shorter than one period can be missed; the course's jobs run for
seconds.

Slurm's daemons (``slurmctld``, ``slurmd``, which lesson 11 starts) are left out: they
listen on every interface by design, to serve other hosts, and have no setting to narrow it.
A cell that shows an all-interfaces listener on purpose (lesson 03's bare ``TCPStore``,
lesson 05's ``torch.distributed.launch``) carries the comment :data:`ON_PURPOSE`; a test
does so with ``@pytest.mark.listens_everywhere``. Network namespaces (lesson 11) have
tables of their own and are not read. Linux only: elsewhere the plugin does nothing.

Registered by ``-p listeners`` in pyproject.toml's ``addopts``.
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import threading
import time

import psutil
import pytest

PERIOD_S = 0.2
ON_PURPOSE = "listens on every interface, on purpose"
TABLES = (pathlib.Path("/proc/net/tcp"), pathlib.Path("/proc/net/tcp6"))
LISTEN = "0A"
CLUSTER_DAEMONS = frozenset({"slurmctld", "slurmd"})


def _address(hex_ip: str) -> str:
    """The text form of /proc/net/tcp's hex address (4 or 16 bytes, each 32-bit word in
    host order, i.e. little-endian on x86 and arm64)."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_inodes() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket of this network
    namespace."""
    found = {}
    for table in TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN:
                hex_ip, hex_port = fields[1].split(":")
                found[int(fields[9])] = (_address(hex_ip), int(hex_port, 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open (empty if it is gone)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (
        ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback
    )


class ListenerWatch:
    """Background sampler of the non-loopback listeners of this process tree.

    ``seen`` holds ``(time.monotonic(), address, port, pid, command)`` records, one per
    listener per sample, for listeners that are not on loopback.
    """

    def __init__(self, period_s: float = PERIOD_S):
        self.period_s = period_s
        self.seen: list[tuple[float, str, int, int, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._me = psutil.Process()
        self._thread = threading.Thread(target=self._run, name="listener-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> None:
        listening = {i: a for i, a in listening_inodes().items() if not is_loopback(a[0])}
        if not listening:
            return
        try:
            tree = [self._me, *self._me.children(recursive=True)]
        except psutil.Error:
            return
        now = time.monotonic()
        for proc in tree:
            try:
                if proc.name() in CLUSTER_DAEMONS:
                    continue
            except psutil.Error:
                continue
            for inode in socket_inodes(proc.pid) & listening.keys():
                try:
                    command = " ".join(proc.cmdline()[:4])
                except psutil.Error:
                    command = "?"
                with self._lock:
                    self.seen.append((now, *listening[inode], proc.pid, command))

    def since(self, start: float) -> list[tuple[float, str, int, int, str]]:
        with self._lock:
            return [record for record in self.seen if record[0] >= start]

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()


WATCH = pytest.StashKey[ListenerWatch]()


def _on_purpose(item: pytest.Item) -> bool:
    if item.get_closest_marker("listens_everywhere") is not None:
        return True
    cell = getattr(item, "cell", None)  # nbval's notebook cell
    return cell is not None and ON_PURPOSE in getattr(cell, "source", "")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "listens_everywhere(reason): this test starts a non-loopback listener"
    )
    if pathlib.Path("/proc/net/tcp").exists():
        watch = ListenerWatch()
        watch.start()
        config.stash[WATCH] = watch


def pytest_unconfigure(config: pytest.Config) -> None:
    watch = config.stash.get(WATCH, None)
    if watch is not None:
        watch.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    watch = item.config.stash.get(WATCH, None)
    if watch is None or _on_purpose(item):
        return (yield)
    start = time.monotonic()
    result = yield
    watch.sample()  # one more look before the test's processes are gone
    found = sorted({(a, p, pid, cmd) for _, a, p, pid, cmd in watch.since(start)})
    if found:
        lines = "\n".join(f"  {a} port {p}: pid {pid} ({cmd})" for a, p, pid, cmd in found)
        raise AssertionError(
            "a process this test started listened on an address other than loopback, "
            f"reachable from other machines:\n{lines}\nBind it to 127.0.0.1 (the launcher's "
            "stores and gloo's sockets already are), or mark the test listens_everywhere."
        )
    return result
