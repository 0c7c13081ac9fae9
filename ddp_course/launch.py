"""Launch a script under ``torchrun`` from a notebook, a test or the shell.

Why not ``!torchrun ...`` in a cell: a failing or hanging ``!`` command still
passes under nbval, its output is lost under pytest, and a killed
``torchrun`` leaves its workers behind holding the port. This launcher

- prints one line saying what runs, as a learner would type it
  (``$ torchrun --nproc_per_node=2 ../scripts/05_train_ddp.py --epochs 1``),
  and one closing line with the wall time;
- chooses the device for the whole job with
  :func:`ddp_course.runtime.device_plan`: CUDA only when every rank gets a GPU,
  otherwise CPU and gloo, said in one line and passed to the workers in
  ``DDP_COURSE_DEVICE``;
- starts torchrun's agent (``torch.distributed.run``) with a c10d rendezvous
  on a free loopback port (no fixed ``MASTER_PORT`` to collide), and keeps a
  single-node job reachable from this machine only: every store and gloo
  listen on the loopback interface, never on all interfaces;
- keeps per-rank logs (torchrun's ``--log-dir``) and streams rank 0's
  output live through a pipe, printed from Python so Jupyter and pytest
  both capture it;
- on a timeout, kills the whole process group, workers included;
- on a failure, raises :class:`LaunchError` naming the failing rank and
  showing the end of its traceback;
- hands back the JSON results file the script wrote, if asked;
- leaves nothing in the temporary directory (the agent's temporary files go
  into the launcher's own temporary folder, removed afterwards).

Run as a module, ``python -m ddp_course.launch [--tmpdir DIR] TORCHRUN_ARGS``
is torchrun with loopback-only stores; :func:`torchrun` starts it that way.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import linecache
import os
import pathlib
import random
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from . import runtime
from .runtime import DEVICE_ENV, device_plan

__all__ = [
    "HEARTBEAT_ENV",
    "HEARTBEAT_S",
    "LaunchError",
    "LaunchResult",
    "LaunchTimeout",
    "free_port",
    "is_timeout",
    "planned_env",
    "loopback_interface",
    "python",
    "torchrun",
]


class LaunchError(RuntimeError):
    """A launched job failed.

    Attributes:
        rank: the global rank that failed first (``None`` if unknown).
        returncode: torchrun's exit code.
        logs: per-rank output ``{rank: text}``.
    """

    def __init__(self, message: str, rank: int | None, returncode: int, logs: dict[int, str]):
        super().__init__(message)
        self.rank, self.returncode, self.logs = rank, returncode, logs


class LaunchTimeout(LaunchError):
    """The job ran past its timeout; every process of it was killed."""


@dataclasses.dataclass
class LaunchResult:
    """A finished, successful job.

    Attributes:
        returncode: always 0 (failures raise).
        output: rank 0's output as streamed (stdout and stderr).
        logs: every rank's output ``{rank: text}`` from the per-rank logs.
        results: the parsed JSON results file, or ``None``.
        wall_s: seconds from launch to exit, including process start-up.
    """

    returncode: int
    output: str
    logs: dict[int, str]
    results: Any
    wall_s: float


def _ephemeral_ports() -> range:
    # The kernel picks a client's source port from this range. Linux says so
    # in /proc; elsewhere assume the IANA range (macOS, Windows).
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
    ephemeral = _ephemeral_ports()
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


_PREFIX = re.compile(r"^\[[^\]]*?(\d+)\]:", re.MULTILINE)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.MULTILINE)
_FAILED_AT = re.compile(r"\[ddp_course\] rank (\d+) failed at t=([\d.]+)")
_ROOT_RANK = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)", re.DOTALL)
# torchrun's own log lines (glog format: W1121 06:13:26.123 ..., and c10d's
# C++ lines [W1121 06:13:26.123 ...]); the echo hides its warnings, notes and
# errors (the launcher says what failed itself), the failure report keeps everything.
_TORCHRUN_LOG = re.compile(r"^\[?[WIE]\d{4} \d\d:\d\d:\d\d")
_TORCHRUN_BANNER = ("*****************************************", "Setting OMP_NUM_THREADS")
# Flags that make a job span several nodes; the launcher then leaves
# addresses and interfaces to them instead of pinning everything to loopback.
_MULTI_NODE_FLAGS = frozenset({
    "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend",
    "--master-addr", "--master_addr", "--master-port", "--master_port",
    "--node-rank", "--node_rank", "--local-addr", "--local_addr",
})  # fmt: skip


def loopback_interface() -> str | None:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux,
    ``lo0`` on macOS), or ``None`` if there is none."""
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and address.address.startswith("127."):
                return name
    return None


def _is_multi_node(extra_torchrun_args: Sequence[str]) -> bool:
    for arg in extra_torchrun_args:
        flag, _, value = arg.partition("=")
        if flag in _MULTI_NODE_FLAGS or (flag == "--nnodes" and value not in ("1", "1:1")):
            return True
    return False


def _shown_path(script: str | os.PathLike) -> str:
    # What a learner would type: the path as given when relative, else
    # relative to the current folder, else the bare name; never an absolute
    # path of this machine in a stored output.
    path = pathlib.Path(script)
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return path.name


def _gpu_count() -> int:
    return runtime.gpu_count()


# What a collective that waited too long leaves in a rank's log, on either
# backend. gloo raises in the rank's thread: "... Timed out waiting 5000ms for
# recv operation to complete". nccl's host call returns at once; its watchdog
# thread later logs "Watchdog caught collective operation timeout:
# WorkNCCL(...) ran for 5001 milliseconds before timing out" and takes the
# process down. A store wait that runs out says "Timed out after ...".
_TIMEOUT = re.compile(r"timed out|before timing out|collective operation timeout", re.IGNORECASE)


def is_timeout(text: str) -> bool:
    """Whether ``text`` (a rank's log) shows a collective or store timeout on
    gloo or nccl (see the comment above for the words each backend uses)."""
    return _TIMEOUT.search(text) is not None


def _read_rank_logs(log_dir: pathlib.Path) -> dict[int, str]:
    # torchrun writes <log_dir>/<run_id>/attempt_<k>/<local_rank>/{stdout,stderr}.log;
    # one node here, so the local rank is the global rank.
    logs: dict[int, str] = {}
    for rank_dir in sorted(log_dir.glob("*/attempt_*/*")):
        if not rank_dir.name.isdigit():
            continue
        text = ""
        for name in ("stdout.log", "stderr.log"):
            path = rank_dir / name
            if path.exists():
                text += path.read_text(errors="replace")
        rank = int(rank_dir.name)
        logs[rank] = logs.get(rank, "") + text
    return logs


def _failing_rank(torchrun_output: str, logs: dict[int, str]) -> int | None:
    # Ranks inside ddp_course.runtime.distributed() stamp the time they
    # failed; the earliest is the cause, the others died of its absence.
    stamps = [
        (float(t), int(rank)) for text in logs.values() for rank, t in _FAILED_AT.findall(text)
    ]
    if stamps:
        return min(stamps)[1]
    match = _ROOT_RANK.search(torchrun_output)
    if match:
        return int(match.group(1))
    for rank, text in sorted(logs.items()):
        if "Traceback (most recent call last)" in text:
            return rank
    return None


def _tail_traceback(text: str, lines: int = 25) -> str:
    text = _RANK_PREFIX.sub("", text)
    start = text.rfind("Traceback (most recent call last)")
    body = text[start:] if start >= 0 else text
    return "\n".join(body.rstrip().splitlines()[-lines:])


_FRAME = re.compile(
    r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE
)
_FAULTHANDLER_DUMP = "Fatal Python error: Aborted"


def _dump_python_stacks(proc: subprocess.Popen, script: pathlib.Path, wait_s: float = 5.0) -> None:
    # Every rank runs with PYTHONFAULTHANDLER=1, so SIGABRT makes it print the
    # Python stack of each of its threads to stderr (its log) before it dies:
    # the stack of a hung job at the moment it was stopped, at no cost while
    # the job runs.
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    ranks = []
    for p in procs:
        try:
            cmdline = p.cmdline()
        except psutil.Error:
            continue
        if str(script.resolve()) in cmdline and "ddp_course.launch" not in cmdline:
            ranks.append(p)
    for p in ranks:
        try:
            p.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ranks, timeout=wait_s)


def _where_stuck(logs: dict[int, str], script: pathlib.Path) -> str:
    """One line per rank: the script line and the innermost Python function it was
    in when faulthandler dumped its stack, or '' when no rank dumped one."""
    lines = []
    for rank, text in sorted(logs.items()):
        start = text.rfind(_FAULTHANDLER_DUMP)
        if start < 0:
            continue
        frames = list(_FRAME.finditer(_RANK_PREFIX.sub("", text[start:])))
        if not frames:
            continue
        innermost = frames[0]  # faulthandler lists the most recent call first
        mine = next((f for f in frames if pathlib.Path(f["file"]).name == script.name), None)
        where = (
            f"in {innermost['func']} ({pathlib.Path(innermost['file']).name}:{innermost['line']})"
        )
        if mine is not None and mine is not innermost:
            code = linecache.getline(mine["file"], int(mine["line"])).strip()
            where += f", called from {script.name}:{mine['line']}: {code}"
        lines.append(f"  rank {rank}: {where}")
    if not lines:
        return ""
    return (
        "\nWhere each rank was when it was stopped (its Python stack, by faulthandler):\n"
        + "\n".join(lines)
    )


def _kill_job(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    # torchrun starts each worker in a session of its own, so killing
    # torchrun's process group does not reach them: list the whole tree
    # first, ask torchrun to stop (it forwards SIGTERM to its workers), then
    # SIGKILL whatever of the tree is still alive.
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        proc.kill()
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=grace_s)
    proc.wait()


# Seconds between the "still running" lines of a job that echoes nothing: a
# learner sees it is alive. DDP_COURSE_HEARTBEAT_S overrides it; 0 turns the
# lines off (``python -m ddp_course execute`` does, so stored outputs hold none).
HEARTBEAT_S = 10.0
HEARTBEAT_ENV = "DDP_COURSE_HEARTBEAT_S"


def _heartbeat_s() -> float:
    value = os.environ.get(HEARTBEAT_ENV, "")
    try:
        return float(value) if value else HEARTBEAT_S
    except ValueError:
        raise ValueError(f"{HEARTBEAT_ENV}={value!r} is not a number of seconds") from None


def _wait(
    proc: subprocess.Popen, name: str, start: float, timeout_s: float, heartbeat: bool
) -> int:
    """``proc.wait(timeout_s)``, printing ``  ... NAME still running, N s`` every
    :data:`HEARTBEAT_S` seconds when ``heartbeat``; raises ``TimeoutExpired``."""
    deadline = start + timeout_s
    every = _heartbeat_s()
    heartbeat = heartbeat and every > 0
    while True:
        left = deadline - time.perf_counter()
        try:
            return proc.wait(timeout=max(0.0, min(left, every if heartbeat else left)))
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= deadline:
                raise
            if heartbeat:
                print(
                    f"  ... {name} still running, {time.perf_counter() - start:.0f} s", flush=True
                )


def _no_core_files() -> None:
    # A rank aborted for its stack dump must not leave a core file behind.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _check_script(script: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(script)
    if not path.exists():
        raise FileNotFoundError(f"no script at {path.resolve()}")
    return path


def _start(
    cmd: Sequence[str], env: Mapping[str, str], echo: bool, tag: str = ""
) -> tuple[subprocess.Popen, threading.Thread, list[str]]:
    """Start ``cmd`` in a session of its own and a thread that reads its output.

    Returns the process, the reader thread and the list the thread appends every
    output line to. With ``echo``, lines other than torchrun's own log lines are
    printed as they come, after ``tag`` (e.g. ``"[node 1] "``).
    """
    # PYTHONFAULTHANDLER: a rank stopped with SIGABRT prints its Python stack.
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **env}
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        text=True,
        errors="replace",
        start_new_session=True,  # a group of its own to signal
        preexec_fn=_no_core_files,
    )
    lines: list[str] = []

    def pump() -> None:
        # Read through a pipe and print from Python: output a child writes to
        # an inherited stdout is lost under pytest/nbval.
        assert proc.stdout is not None
        shown = False
        for line in proc.stdout:
            lines.append(line)
            if not echo or _TORCHRUN_LOG.match(line) or line.startswith(_TORCHRUN_BANNER):
                continue
            text = _PREFIX.sub("", line, count=1)
            if shown or text.strip():  # drop the blank lines around torchrun's banner
                shown = True
                print(tag + text, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return proc, reader, lines


def _run_job(
    cmd: list[str],
    script: pathlib.Path,
    nproc: int,
    timeout_s: float,
    env: Mapping[str, str],
    echo: bool,
    logs_path: pathlib.Path | None,
    results_path: pathlib.Path | None,
    shown: str,
) -> LaunchResult:
    """Start ``cmd`` in a session of its own, stream it, wait, and judge it.

    ``shown`` is the command as a learner would type it, printed first so a
    cell that echoes nothing still says what it is waiting for.
    """
    print(f"$ {shown}", flush=True)
    start = time.perf_counter()
    proc, reader, lines = _start(cmd, env, echo)

    def rank_logs() -> dict[int, str]:
        return _read_rank_logs(logs_path) if logs_path else {0: "".join(lines)}

    try:
        returncode = _wait(proc, script.name, start, timeout_s, heartbeat=not echo)
    except subprocess.TimeoutExpired:
        _dump_python_stacks(proc, script)
        _kill_job(proc)
        reader.join(timeout=5)
        logs = rank_logs()
        raise LaunchTimeout(
            f"{script.name} ran past its {timeout_s:g} s timeout with {nproc} "
            "rank(s); every process of the job was killed. A hang usually means "
            "the ranks called different collectives or different numbers of them."
            + _where_stuck(logs, script),
            None, -signal.SIGKILL, logs,
        ) from None  # fmt: skip
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    reader.join(timeout=5)
    wall_s = time.perf_counter() - start
    output = "".join(lines)
    logs = rank_logs()
    if returncode != 0:
        rank = _failing_rank(output, logs)
        where = f"rank {rank}" if rank is not None else "an unknown rank"
        detail = _tail_traceback(logs.get(rank, output) if rank is not None else output)
        raise LaunchError(
            f"{script.name} failed on {where} (exit code {returncode}).\n"
            f"--- end of {where}'s output ---\n{detail}",
            rank, returncode, logs,
        )  # fmt: skip
    data = None
    if results_path is not None:
        if not results_path.exists():
            raise LaunchError(f"{script.name} exited cleanly but wrote no --results file",
                              None, 0, logs)  # fmt: skip
        data = json.loads(results_path.read_text())
    print(f"{script.name} finished in {wall_s:.1f} s", flush=True)
    return LaunchResult(returncode, output, logs, data, wall_s)


def torchrun(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    nproc: int = 2,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    results: bool = False,
    echo: bool = True,
    extra_torchrun_args: Sequence[str] = (),
    gpus: int | None = None,
) -> LaunchResult:
    """Run ``torchrun --nproc_per_node=nproc script *args`` and wait for it.

    Prints ``$ torchrun ...`` (the command a learner would type) when the
    job starts and ``<script> finished in <s> s`` when it ends. The device
    follows :func:`ddp_course.runtime.device_plan`: with fewer GPUs than
    ``nproc`` the job runs on CPU with gloo and one line says so; the workers
    learn the plan from ``DDP_COURSE_DEVICE`` (an explicit
    ``DDP_COURSE_DEVICE`` in ``env`` or the environment wins).

    A single-node job listens on loopback only: the rendezvous store and the
    agent's store are bound to 127.0.0.1 and gloo and nccl use the loopback
    interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``), unless
    ``extra_torchrun_args`` name a rendezvous endpoint, master address or
    several nodes, or ``env`` sets those variables.

    Args:
        script: path of the Python script (relative to the current folder).
        args: the script's own arguments.
        nproc: processes (ranks) on this machine.
        timeout_s: wall-clock limit in seconds for the whole job.
        env: extra environment variables for every rank.
        log_dir: where torchrun keeps per-rank logs (default: a temporary
            folder, removed afterwards).
        results: pass ``--results <file>`` to the script and return the
            JSON it wrote there.
        echo: print rank 0's output live. The first and last lines are
            printed either way; without echo, a line every
            :data:`HEARTBEAT_S` seconds says the job is still running.
        extra_torchrun_args: more torchrun flags, e.g. ``["--max-restarts=1"]``.
        gpus: GPUs on this machine for the device rule; default
            ``torch.cuda.device_count()`` (0 without CUDA). ``gpus=0`` runs
            the job on CPU.

    Returns:
        :class:`LaunchResult`.

    Raises:
        FileNotFoundError: if ``script`` does not exist.
        ValueError: if ``nproc`` < 1 or ``gpus`` < 0.
        LaunchTimeout: the job ran past ``timeout_s``; all its processes
            were killed.
        LaunchError: a rank failed; the message names it and shows its
            traceback.
    """
    path = _check_script(script)
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, not {nproc}")
    env, prefix = planned_env(env, nproc, gpus)
    single_node = not _is_multi_node(extra_torchrun_args)
    loopback = loopback_interface() if single_node else None
    if loopback is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in env and name not in os.environ:
                env[name] = loopback
    with tempfile.TemporaryDirectory(prefix="ddp_course_") as tmp:
        logs_path = pathlib.Path(log_dir) if log_dir is not None else pathlib.Path(tmp, "logs")
        results_path = pathlib.Path(tmp, "results.json") if results else None
        agent_tmp = pathlib.Path(tmp, "agent")
        agent_tmp.mkdir()
        cmd = [
            sys.executable, "-m", "ddp_course.launch", "--tmpdir", str(agent_tmp),
            f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            *(["--local-addr=127.0.0.1"] if single_node else []),
            f"--log-dir={logs_path}",
            "--tee=3",
            "--local-ranks-filter=0",
            *extra_torchrun_args,
            str(path.resolve()),
            *args,
        ]  # fmt: skip
        if results_path is not None:
            cmd += ["--results", str(results_path)]
        shown = shlex.join(
            ["torchrun", f"--nproc_per_node={nproc}", *extra_torchrun_args, _shown_path(script),
             *args]
        )  # fmt: skip
        return _run_job(
            cmd, path, nproc, timeout_s, env, echo, logs_path, results_path, prefix + shown
        )


def python(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    results: bool = False,
    echo: bool = True,
    reference_for: int = 1,
    gpus: int | None = None,
) -> LaunchResult:
    """Run ``python script *args`` as one plain process (no torchrun), like
    :func:`torchrun` otherwise: first and last lines, live output, timeout,
    errors, results.

    The process runs on the device a rank of a ``reference_for``-rank job
    would get (:func:`ddp_course.runtime.device_plan`), passed to it in
    ``DDP_COURSE_DEVICE``: a one-process reference compared with a 2-rank job
    on a one-GPU machine runs on the CPU like the ranks, not on ``cuda:0``.

    Args:
        reference_for: ranks of the job this run is compared with (1: a
            plain run, on a GPU whenever there is one).
        gpus: GPUs for the device rule; default
            :func:`ddp_course.runtime.gpu_count`.

    ``logs`` of the result is ``{0: output}``. Raises as :func:`torchrun`,
    and ``ValueError`` if ``reference_for`` < 1.
    """
    path = _check_script(script)
    if reference_for < 1:
        raise ValueError(f"reference_for must be at least 1, not {reference_for}")
    env, prefix = planned_env(env, reference_for, gpus)
    with tempfile.TemporaryDirectory(prefix="ddp_course_") as tmp:
        results_path = pathlib.Path(tmp, "results.json") if results else None
        cmd = [sys.executable, str(path.resolve()), *args]
        if results_path is not None:
            cmd += ["--results", str(results_path)]
        shown = prefix + shlex.join(["python", _shown_path(script), *args])
        return _run_job(cmd, path, 1, timeout_s, env, echo, None, results_path, shown)


def planned_env(
    env: Mapping[str, str] | None, nproc: int, gpus: int | None
) -> tuple[dict[str, str], str]:
    """The environment of a job of ``nproc`` ranks, with the device plan in it.

    What :func:`torchrun` and :func:`python` pass to their processes: ``env``
    plus ``DDP_COURSE_DEVICE`` set to the plan's device type
    (:func:`ddp_course.runtime.device_plan` for ``nproc`` ranks on ``gpus``
    GPUs, default :func:`ddp_course.runtime.gpu_count`), unless ``env`` or
    this process's environment sets it already. On a fallback (GPUs, but
    fewer than ranks) it prints the plan's reason.

    Returns:
        ``(env, prefix)``: the new mapping, and ``"DDP_COURSE_DEVICE=cpu "``
        to show in front of the command line on a fallback, else ``""``.
    """
    env = dict(env or {})
    if DEVICE_ENV in env or DEVICE_ENV in os.environ:
        return env, ""
    plan = device_plan(nproc, _gpu_count() if gpus is None else gpus)
    env[DEVICE_ENV] = plan.device_type
    if not plan.fallback:
        return env, ""
    print(plan.reason, flush=True)
    return env, f"{DEVICE_ENV}=cpu "


# --- torchrun with loopback-only stores (what ``python -m ddp_course.launch`` runs) ---

_TCPSTORE_ARGS = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
                  "master_listen_fd", "use_libuv")  # fmt: skip


def _loopback_family(host: str) -> int | None:
    if host == "localhost":
        return socket.AF_INET
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    return socket.AF_INET if address.version == 4 else socket.AF_INET6


def _loopback_tcpstore(base: type) -> type:
    """A subclass of ``torch.distributed.TCPStore`` whose server listens on
    loopback only when its host is a loopback address.

    TCPStore's server binds every interface (``::``) whatever its host name;
    the one way to narrow it is ``master_listen_fd``, a socket already bound
    (https://pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore).
    """

    class LoopbackTCPStore(base):
        def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
            kwargs.update(zip(_TCPSTORE_ARGS, args))
            family = _loopback_family(host_name)
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None and family:
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((host_name, port))
                except OSError as exc:
                    sock.close()
                    # RuntimeError is what torch's rendezvous expects from a
                    # store that cannot start (it then retries as a client).
                    raise RuntimeError(f"cannot listen on {host_name}:{port}: {exc}") from exc
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns it now
            super().__init__(host_name, port, **kwargs)

    return LoopbackTCPStore


def _torchrun_on_loopback(argv: Sequence[str]) -> None:
    """torchrun's ``main`` with every TCPStore server on a loopback host bound
    to loopback, and the agent's temporary files in ``--tmpdir DIR``."""
    import torch.distributed as dist
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    argv = list(argv)
    if argv[:1] == ["--tmpdir"]:
        # Only the agent's own files: the workers keep the usual temporary
        # folder (compile caches live there).
        tempfile.tempdir = argv[1]
        argv = argv[2:]
    store = _loopback_tcpstore(dist.TCPStore)
    # The rendezvous backends bound the name at import; the agent's own store
    # is created through ``dist.TCPStore``.
    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):
        if hasattr(module, "TCPStore"):
            module.TCPStore = store
    run.main(argv)


if __name__ == "__main__":
    _torchrun_on_loopback(sys.argv[1:])
