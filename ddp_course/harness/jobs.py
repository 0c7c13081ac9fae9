"""Running a job's processes: start one in a session of its own with its output
streamed through a pipe, wait for it with a heartbeat, dump the Python stacks of a hung
job's ranks, and kill the whole process tree."""

from __future__ import annotations

import os
import pathlib
import re
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from .failures import strip_rank_prefix

__all__ = [
    "HEARTBEAT_ENV",
    "HEARTBEAT_S",
    "check_script",
    "dump_python_stacks",
    "job_environment",
    "kill_job",
    "no_core_files",
    "processes_running",
    "read_output",
    "shown_path",
    "start_job",
    "wait_job",
]

# torchrun's own log lines (glog format: W1121 06:13:26.123 ..., and c10d's
# C++ lines [W1121 06:13:26.123 ...]); the echo hides its warnings, notes and
# errors (the launcher says what failed itself), the failure report keeps everything.
_TORCHRUN_LOG = re.compile(r"^\[?[WIE]\d{4} \d\d:\d\d:\d\d")
_TORCHRUN_BANNER = ("*****************************************", "Setting OMP_NUM_THREADS")


def shown_path(script: str | os.PathLike) -> str:
    """What a learner would type: the path as given when relative, else relative to the
    current folder, else the bare name; never an absolute path of this machine in a stored
    output."""
    path = pathlib.Path(script)
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return path.name


def dump_python_stacks(proc: Any, script: pathlib.Path, wait_s: float = 5.0) -> None:
    """Send SIGABRT to every rank of the job started as ``proc`` (not to the agent), and
    wait up to ``wait_s`` seconds for them to die.

    A rank is a process below ``proc`` whose command line names ``script``: a rank
    torchrun started as ``python -u script``, or one forked from the agent (its command
    line is the agent's, also for an agent forked by :mod:`.agent_server`). ``proc``
    itself counts when it is not torchrun's agent (a plain ``python script`` run).

    Every rank runs with PYTHONFAULTHANDLER=1, so SIGABRT makes it print the Python stack
    of each of its threads to stderr (its log) before it dies: the stack of a hung job at
    the moment it was stopped, at no cost while the job runs."""
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
        agent = p is root and "ddp_course.harness.loopback" in cmdline
        if str(script.resolve()) in cmdline and not agent:
            ranks.append(p)
    for p in ranks:
        try:
            p.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ranks, timeout=wait_s)


def processes_running(marker: str) -> list[psutil.Process]:
    """Every live process of this machine (zombies, which hold nothing, left out) whose
    command line contains ``marker``: a script's name or folder, to check that a job left
    nothing behind. Processes that end or cannot be read meanwhile are skipped."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any(marker in a for a in p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def kill_job(proc: Any, grace_s: float = 5.0) -> None:
    """Stop the job started as ``proc`` and every process below it; returns once reaped.

    torchrun starts each worker in a session of its own, so killing torchrun's process
    group does not reach them: list the whole tree first, ask torchrun to stop (it forwards
    SIGTERM to its workers), wait ``grace_s`` seconds, then SIGKILL whatever of the tree is
    still alive."""
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


def wait_job(proc: Any, name: str, start: float, timeout_s: float, heartbeat: bool) -> int:
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


def no_core_files() -> None:
    """``preexec_fn`` of a job's process: no core file (a rank aborted for its stack dump
    must not leave one behind)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def check_script(script: str | os.PathLike) -> pathlib.Path:
    """``script`` as a path; raises FileNotFoundError (with the full path) if it is missing."""
    path = pathlib.Path(script)
    if not path.exists():
        raise FileNotFoundError(f"no script at {path.resolve()}")
    return path


def job_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What a job's processes get: this process's environment, unbuffered output,
    Python's fault handler on (a rank stopped with SIGABRT prints its Python stack),
    then ``env``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **env}


def start_job(
    cmd: Sequence[str], env: Mapping[str, str], echo: bool, tag: str = ""
) -> tuple[subprocess.Popen, threading.Thread, list[str]]:
    """Start ``cmd`` in a session of its own and a thread that reads its output.

    Returns the process, the reader thread and the list the thread appends every
    output line to (see :func:`read_output`).
    """
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=job_environment(env),
        text=True,
        errors="replace",
        start_new_session=True,  # a group of its own to signal
        preexec_fn=no_core_files,
    )
    return proc, *read_output(proc, echo, tag)


def read_output(proc: Any, echo: bool, tag: str = "") -> tuple[threading.Thread, list[str]]:
    """A thread that reads ``proc.stdout`` (a text stream) line by line, and the list it
    appends them to. With ``echo``, lines other than torchrun's own log lines are
    printed as they come, after ``tag`` (e.g. ``"[node 1] "``)."""
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
            text = strip_rank_prefix(line)
            if shown or text.strip():  # drop the blank lines around torchrun's banner
                shown = True
                print(tag + text, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return reader, lines
