"""torchrun's agents forked from one warm process (a fork server) instead of started
as new interpreters.

Every job :func:`ddp_course.harness.launch.torchrun` runs begins with an agent,
``python -m ddp_course.harness.loopback ...``, that spends about 4 s of CPU importing
torch, ``torch._dynamo`` and ``torch.distributed`` before it starts its first rank,
and about 1 s leaving (measured by ``benchmarks/launch_floor.py``). On a 2-core laptop
running a test suite of a few hundred short jobs, that floor is minutes.
:class:`AgentServer` pays it once: a process that imports all of it, then, for each
job, forks a copy of itself that runs the agent with the job's arguments,
environment, working folder and output pipe. The ranks are then forked from that
agent (:mod:`.forked_ranks`), so no process of a job imports torch. This is what
``multiprocessing``'s ``forkserver`` start method does for its workers
(https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods).

The server talks to its launcher over a socket pair, not a listening socket: no
other process can ask it to run anything, and it exits when the launcher does
(end of file on its socket). Per job the launcher sends one request, the job's
standard streams and one end of a new socket pair; the server forks a waiter,
which forks the agent in a session of its own, sends back its pid, waits for it
and sends its exit status and the CPU seconds it and its ranks used. A
:class:`ServedJob` is the launcher's handle: what :mod:`.jobs` needs of
``subprocess.Popen`` (``pid``, ``stdout``, ``poll``, ``wait``, ``kill``).

A plain one-process run (:func:`ddp_course.harness.launch.python`: a script without
torchrun, such as the one-process reference a lesson compares its ranks with) is forked
the same way and runs its script as a forked rank does
(:func:`.forked_ranks.rank_entrypoint`): about 3 s of CPU less per run.

Only variables read when a process starts need care: the server imported torch
under the environment it was started with, so a job whose environment differs
from it in anything but :data:`RUNTIME_VARIABLES` (variables the agent and ranks
read later, e.g. ``DDP_COURSE_DEVICE``, ``GLOO_SOCKET_IFNAME``) starts its agent as
a new interpreter, as before; and when the launcher's own environment changes in
anything else, the next job gets a new server. ``DDP_COURSE_AGENT_SERVER=0`` turns the server off
(:func:`enabled`); ``DDP_COURSE_FORK_RANKS=0`` turns off both.
"""

from __future__ import annotations

import atexit
import io
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from . import agent_fork
from .jobs import no_core_files

__all__ = [
    "RUNTIME_VARIABLES",
    "SERVER_ENV",
    "AgentServer",
    "ServedJob",
    "ServerSlot",
    "enabled",
    "servable",
]

# ``DDP_COURSE_AGENT_SERVER=0`` starts every agent as a new interpreter.
SERVER_ENV = "DDP_COURSE_AGENT_SERVER"

# Variables a job may set that no process reads while it imports torch: the course's
# own (read when a script runs), the interfaces gloo and nccl bind (read when a group
# is made), torchrun's store sharing (read by the agent at rendezvous), the thread
# count (the ranks set torch's pool from it, see .forked_ranks) and the test pytest is
# running (it sets PYTEST_CURRENT_TEST for each; were it counted, every test of a suite
# would start a server of its own). A job that sets anything else starts its agent as
# a new interpreter, and a launcher whose environment changed in anything else gets a
# new server.
RUNTIME_VARIABLES = (
    "DDP_COURSE_",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "OMP_NUM_THREADS",
    "PYTEST_CURRENT_TEST",
)

_START_TIMEOUT_S = 120.0


def enabled(env: Mapping[str, str]) -> bool:
    """Whether agents are forked from a server: ``DDP_COURSE_AGENT_SERVER`` in ``env``,
    else in this process's environment, ``"1"`` (the default) or ``"0"``; never where
    the kernel has no ``/proc/self/stat`` (see :func:`.agent_fork.set_command_line`).

    Raises:
        ValueError: the variable is set to something other than ``"0"`` or ``"1"``.
    """
    setting = env.get(SERVER_ENV, os.environ.get(SERVER_ENV, "1"))
    if setting not in ("0", "1"):
        raise ValueError(f"{SERVER_ENV}={setting!r}: use 1 (fork the agents) or 0")
    # Without /proc (macOS) a forked agent cannot show its own command line.
    return setting == "1" and agent_fork.command_lines_settable()


def servable(base: Mapping[str, str], job: Mapping[str, str]) -> bool:
    """Whether a job whose processes get environment ``job`` can run in a server
    started with environment ``base``: they differ only in :data:`RUNTIME_VARIABLES`."""
    keys = set(base) | set(job)
    differ = {k for k in keys if base.get(k) != job.get(k)}
    return all(k.startswith(RUNTIME_VARIABLES) for k in differ)


class ServedJob:
    """A job's agent forked by an :class:`AgentServer`: the part of ``subprocess.Popen``
    the launcher uses.

    Attributes:
        pid: the agent's process id; it leads a session (and process group) of its own.
        stdout: text stream of the agent's standard output and error.
        returncode: ``None`` while it runs; then its exit code, or ``-N`` after signal N.
        cpu_s: CPU seconds (user + system) of the agent and every rank it waited for,
            known once it has exited.
    """

    def __init__(self, status: socket.socket, stdout: io.TextIOBase, args: Sequence[str]) -> None:
        self._status = agent_fork.Messages(status)
        self.stdout = stdout
        self.args = list(args)
        self.returncode: int | None = None
        self.cpu_s: float | None = None
        started = self._status.read()
        if started is None:
            raise OSError("the agent server stopped before it started the agent")
        self.pid: int = started["pid"]

    def poll(self) -> int | None:
        """The exit code if the agent has exited, else None."""
        if self.returncode is None and self._status.ready(0):
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` seconds; raises ``subprocess.TimeoutExpired``."""
        if self.returncode is None:
            if not self._status.ready(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def _finish(self) -> None:
        done = self._status.read()
        self._status.sock.close()
        # No report: the waiter died (killed with the server); the agent's fate is unknown.
        self.returncode = -signal.SIGKILL if done is None else done["returncode"]
        self.cpu_s = None if done is None else done["cpu_s"]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class AgentServer:
    """A warm process that forks torchrun's agents, started with environment ``env``.

    Starting it costs what one agent's imports cost (a few seconds); every job after
    that starts its agent in milliseconds. It lives until :meth:`close` or until this
    process exits.

    Raises:
        OSError: the server did not start within 120 s, or exited first.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair()
        room = "-" * agent_fork.COMMAND_LINE_BYTES  # see agent_fork.set_command_line
        name, size = agent_fork.ENVIRONMENT_ROOM  # see agent_fork.set_environment
        self._environment_bytes = agent_fork.environment_bytes(self.env) + len(name) + size + 2
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ddp_course.harness.agent_fork", str(theirs.fileno()), room],
            pass_fds=[theirs.fileno()],
            env={**self.env, name: "-" * size},
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=no_core_files,
        )
        theirs.close()
        self._control = ours
        ready = agent_fork.Messages(ours)
        if not ready.ready(_START_TIMEOUT_S) or ready.read() is None:
            self.close()
            raise OSError(
                "the agent server (python -m ddp_course.harness.agent_server) did not start"
            )
        atexit.register(self.close)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def start(self, command: Sequence[str], env: Mapping[str, str]) -> ServedJob:
        """Fork a process that runs ``command`` in this process's working folder with
        environment ``env``: an agent (``python -m ddp_course.harness.loopback ARGS``) or
        a plain run of a script (``python SCRIPT.py ARGS``, as :func:`.launch.python`
        starts one). Its standard output and error go to the returned job's ``stdout``
        pipe, its standard input is ``/dev/null``.

        Raises:
            ValueError: ``command`` is neither, or longer than
                :data:`.agent_fork.COMMAND_LINE_BYTES`, or ``env`` larger than the room the
                server reserved for it (start it as a new interpreter instead).
            OSError: the server is gone.
        """
        command = list(command)
        if command[1:3] == ["-m", "ddp_course.harness.loopback"]:
            kind, args = "agent", command[3:]
        elif len(command) > 1 and command[1].endswith(".py"):
            kind, args = "script", command[1:]
        else:
            raise ValueError(f"not an agent's or a script's command: {command[:3]}")
        if sum(len(os.fsencode(part)) + 1 for part in command) > agent_fork.COMMAND_LINE_BYTES:
            raise ValueError("the agent's command line is longer than the server's room")
        if agent_fork.environment_bytes(env) >= self._environment_bytes:
            raise ValueError("the agent's environment is larger than the server's room")
        status, theirs = socket.socketpair()
        read_end, write_end = os.pipe()
        request = {
            "kind": kind,
            "command": command,
            "args": args,
            "env": dict(env),
            "cwd": os.getcwd(),
        }
        try:
            with open(os.devnull, "rb") as devnull, self._lock:
                fds = [devnull.fileno(), write_end, write_end, theirs.fileno()]
                agent_fork.send(self._control, request, fds)
        except OSError:
            os.close(read_end)
            status.close()
            raise
        finally:
            os.close(write_end)
            theirs.close()
        stdout = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115
        try:
            return ServedJob(status, stdout, command)
        except OSError:
            stdout.close()
            raise

    def close(self) -> None:
        """Stop the server (jobs it started run on)."""
        try:
            self._control.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ServerSlot:
    """The one :class:`AgentServer` of a launching process (a notebook's kernel, a test
    worker), started on first use and replaced by a new one when the environment it
    would start with changed since in a variable read while torch imports (anything
    but :data:`RUNTIME_VARIABLES`, see :func:`servable`), or the harness files its
    agents run changed.

    Raises (from :meth:`get`):
        OSError: a new server did not start.
    """

    def __init__(self) -> None:
        self._server: AgentServer | None = None
        self._sources: dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The running server's process id, or None before the first served job."""
        server = self._server
        return server.pid if server is not None and server.alive() else None

    def get(self, env: Mapping[str, str]) -> AgentServer:
        """The server for jobs whose launcher's environment is ``env``."""
        sources = _harness_sources()
        with self._lock:
            server = self._server
            stale = server is None or not server.alive() or not servable(server.env, env)
            if stale or sources != self._sources:
                if server is not None:
                    server.close()
                self._server, self._sources = None, sources
                server = self._server = AgentServer(env)
            return server


def _harness_sources() -> dict[str, float]:
    # An agent runs these from the server's memory: an edited file needs a new server.
    here = os.path.dirname(os.path.abspath(__file__))
    names = ("agent_fork.py", "forked_ranks.py", "loopback.py")
    return {name: os.stat(os.path.join(here, name)).st_mtime for name in names}
