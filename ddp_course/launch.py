"""Launch a script under ``torchrun`` from a notebook, a test or the shell.

Why not ``!torchrun ...`` in a cell: a failing or hanging ``!`` command still
passes under nbval, its output is lost under pytest, and a killed
``torchrun`` leaves its workers behind holding the port. This launcher

- starts ``python -m torch.distributed.run`` with a c10d rendezvous on a
  free loopback port (no fixed ``MASTER_PORT`` to collide);
- keeps per-rank logs (torchrun's ``--log-dir``) and streams rank 0's
  output live through a pipe, printed from Python so Jupyter and pytest
  both capture it;
- on a timeout, kills the whole process group, workers included;
- on a failure, raises :class:`LaunchError` naming the failing rank and
  showing the end of its traceback;
- hands back the JSON results file the script wrote, if asked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
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

__all__ = ["LaunchError", "LaunchResult", "LaunchTimeout", "free_port", "python", "torchrun"]


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_PREFIX = re.compile(r"^\[[^\]]*?(\d+)\]:", re.MULTILINE)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.MULTILINE)
_FAILED_AT = re.compile(r"\[ddp_course\] rank (\d+) failed at t=([\d.]+)")
_ROOT_RANK = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)", re.DOTALL)
# torchrun's own log lines (glog format: W1121 06:13:26.123 ...); the echo
# hides its warnings and notes, the failure report keeps everything.
_TORCHRUN_LOG = re.compile(r"^[WI]\d{4} \d\d:\d\d:\d\d")
_TORCHRUN_BANNER = ("*****************************************", "Setting OMP_NUM_THREADS")


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


def _check_script(script: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(script)
    if not path.exists():
        raise FileNotFoundError(f"no script at {path.resolve()}")
    return path


def _run_job(
    cmd: list[str],
    script: pathlib.Path,
    nproc: int,
    timeout_s: float,
    env: Mapping[str, str] | None,
    echo: bool,
    logs_path: pathlib.Path | None,
    results_path: pathlib.Path | None,
) -> LaunchResult:
    """Start ``cmd`` in a session of its own, stream it, wait, and judge it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        text=True,
        errors="replace",
        start_new_session=True,  # a group of its own to signal
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
                print(text, end="", flush=True)

    def rank_logs() -> dict[int, str]:
        return _read_rank_logs(logs_path) if logs_path else {0: "".join(lines)}

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_job(proc)
        reader.join(timeout=5)
        raise LaunchTimeout(
            f"{script.name} ran past its {timeout_s:g} s timeout with {nproc} "
            "rank(s); every process of the job was killed. A hang usually means "
            "the ranks called different collectives or different numbers of them.",
            None, -signal.SIGKILL, rank_logs(),
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
) -> LaunchResult:
    """Run ``torchrun --nproc_per_node=nproc script *args`` and wait for it.

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
        echo: print rank 0's output live.
        extra_torchrun_args: more torchrun flags, e.g. ``["--max-restarts=1"]``.

    Returns:
        :class:`LaunchResult`.

    Raises:
        FileNotFoundError: if ``script`` does not exist.
        ValueError: if ``nproc`` < 1.
        LaunchTimeout: the job ran past ``timeout_s``; all its processes
            were killed.
        LaunchError: a rank failed; the message names it and shows its
            traceback.
    """
    path = _check_script(script)
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, not {nproc}")
    with tempfile.TemporaryDirectory(prefix="ddp_course_") as tmp:
        logs_path = pathlib.Path(log_dir) if log_dir is not None else pathlib.Path(tmp, "logs")
        results_path = pathlib.Path(tmp, "results.json") if results else None
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--log-dir={logs_path}",
            "--tee=3",
            "--local-ranks-filter=0",
            *extra_torchrun_args,
            str(path.resolve()),
            *args,
        ]  # fmt: skip
        if results_path is not None:
            cmd += ["--results", str(results_path)]
        return _run_job(cmd, path, nproc, timeout_s, env, echo, logs_path, results_path)


def python(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    results: bool = False,
    echo: bool = True,
) -> LaunchResult:
    """Run ``python script *args`` as one plain process (no torchrun), like
    :func:`torchrun` otherwise: live output, timeout, errors, results.

    ``logs`` of the result is ``{0: output}``. Raises as :func:`torchrun`.
    """
    path = _check_script(script)
    with tempfile.TemporaryDirectory(prefix="ddp_course_") as tmp:
        results_path = pathlib.Path(tmp, "results.json") if results else None
        cmd = [sys.executable, str(path.resolve()), *args]
        if results_path is not None:
            cmd += ["--results", str(results_path)]
        return _run_job(cmd, path, 1, timeout_s, env, echo, None, results_path)
