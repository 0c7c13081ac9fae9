"""The agent server's own side (see :mod:`.agent_server`): what runs in the warm process
and in the agents (and plain one-process runs) it forks.

``python -m ddp_course.harness.agent_fork FD ROOM`` is the server: it imports what an agent
and its ranks need, says ``ready`` on the socket ``FD`` (one end of a socket pair whose other
end the launcher holds), and then, per request, forks a waiter that forks the agent. ``ROOM``
is a padding argument that leaves space for the agents' command lines
(:func:`set_command_line`). The messages both sides exchange are newline-framed JSON
(:func:`send`, :class:`Messages`).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "COMMAND_LINE_BYTES",
    "ENVIRONMENT_ROOM",
    "Messages",
    "command_lines_settable",
    "environment_bytes",
    "send",
    "serve",
    "set_command_line",
    "set_environment",
]

# What every agent imports before its first rank (its ranks add .forked_ranks.PRELOADED).
_AGENT_MODULES = (
    "torch.distributed.run",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
    "ddp_course.harness.loopback",
    "ddp_course.harness.forked_ranks",
)

# Room the server reserves for its agents' command lines (see set_command_line); a
# job whose agent's command is longer starts it as a new interpreter.
COMMAND_LINE_BYTES = 4096
# The variable whose value reserves room for the agents' environments (see
# set_environment), and its size in bytes.
ENVIRONMENT_ROOM = ("DDP_COURSE_AGENT_ENVIRONMENT_ROOM", 4096)
_STAT = "/proc/self/stat"


def _memory_area(first_field: int) -> tuple[int, int]:
    # Fields first_field and first_field + 1 of /proc/self/stat (numbered from 1 as in
    # man 5 proc): the start and end addresses of an area the kernel reads for /proc.
    with open(_STAT, "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()  # field 3 onwards
    return int(fields[first_field - 3]), int(fields[first_field + 1 - 3])


def set_command_line(argv: Sequence[str]) -> bool:
    """Make this process's command line, as ``ps``, psutil and ``/proc/PID/cmdline``
    show it, read ``argv``; returns False (and changes nothing) if it does not fit.

    A forked agent is the server's copy, so its command line would be the server's;
    the launcher's stack dumps, the tests and the lessons find a job's agent and ranks
    by theirs. The kernel reads a command line from the memory where the process's
    arguments were put at start (``arg_start`` to ``arg_end`` in ``/proc/self/stat``,
    see ``man 5 proc``); writing there is how ``setproctitle`` changes it on Linux:
    the arguments joined by spaces, which psutil splits again (separated by NULs when
    an argument holds a space). The server starts with a padding argument of
    :data:`COMMAND_LINE_BYTES` to make room. Ranks forked afterwards inherit the new
    command line.
    """
    arg_start, arg_end = _memory_area(48)
    args = [os.fsencode(arg) for arg in argv]
    if any(b" " in arg or b"\t" in arg or b"\n" in arg for arg in args):
        data, fill = b"".join(arg + b"\0" for arg in args), b"\0"
    else:
        # Separated by spaces, then a NUL, then no NUL at the end: the kernel then shows
        # only the first string, and psutil splits it at the spaces (as for setproctitle);
        # NULs to the end would show thousands of empty arguments.
        data, fill = b" ".join(args) + b"\0", b" "
    size = arg_end - arg_start
    if not arg_start or len(data) >= size:
        return False
    ctypes.memmove(arg_start, data.ljust(size, fill), size)
    return True


def environment_bytes(env: Mapping[str, str]) -> int:
    """Bytes of ``env`` as the kernel keeps a process's environment: ``KEY=VALUE\\0`` each."""
    return sum(len(os.fsencode(k)) + len(os.fsencode(v)) + 2 for k, v in env.items())


def set_environment(env: Mapping[str, str]) -> bool:
    """Make this process's environment, as psutil's ``environ()`` and
    ``/proc/PID/environ`` show it to other processes, read ``env``; returns False (and
    changes nothing) if it does not fit.

    ``os.environ`` is what this process and the processes it starts use; other
    processes read the copy the kernel placed in memory at start (``env_start`` to
    ``env_end`` in ``/proc/self/stat``). A forked agent's copy is the server's, so a rank
    comparing its own environment with its agent's (lesson 03 lists what torchrun
    adds) would count what the course's launcher set for the job as torchrun's. The
    server starts with the variable :data:`ENVIRONMENT_ROOM` to make room; the rest of
    the area is filled with NULs, where psutil stops reading.
    """
    env_start, env_end = _memory_area(50)
    data = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    size = env_end - env_start
    if not env_start or len(data) >= size:
        return False
    ctypes.memmove(env_start, data.ljust(size, b"\0"), size)
    return True


def command_lines_settable() -> bool:
    """Whether this kernel lets a process rewrite its command line (Linux's ``/proc``)."""
    return os.path.exists(_STAT)


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """Write ``message`` as one line of JSON to ``sock``, with the descriptors ``fds``."""
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


class Messages:
    """Newline-framed JSON messages read from a socket, with the descriptors that came
    with them (what :func:`send` writes)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.fds: list[int] = []

    def ready(self, timeout_s: float | None) -> bool:
        if b"\n" in self.buffer:
            return True
        readable, _, _ = select.select([self.sock], [], [], timeout_s)
        return bool(readable)

    def read(self) -> dict[str, Any] | None:
        """The next message, or None at the end of the stream."""
        while b"\n" not in self.buffer:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 8)
            self.fds += fds
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def _run_agent(request: Mapping[str, Any], fds: Sequence[int]) -> None:
    """In the forked agent: take the job's streams, folder and environment, run the
    agent as ``python -m ddp_course.harness.loopback ARGS`` would (or, for a request of
    kind ``script``, the script as ``python SCRIPT ARGS`` would), and exit."""
    os.setsid()  # a session of its own, as the launcher's Popen(start_new_session=True)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    set_environment(request["env"])
    set_command_line(request["command"])
    atexit._clear()  # the server's own exit functions are not the agent's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run = _run_script if request.get("kind") == "script" else _run_loopback
    try:
        code = run(request["args"])
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)


def _run_loopback(args: Sequence[str]) -> int:
    """torchrun's agent with ``args``; returns its exit code."""
    from . import loopback

    sys.argv = [loopback.__file__, *args]
    code = 0
    try:
        loopback.main(list(args))
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        atexit._run_exitfuncs()
    return code


def _run_script(args: Sequence[str]) -> int:
    """``python SCRIPT *ARGS`` in this forked process (``args`` is ``[SCRIPT, *ARGS]``),
    prepared as a forked rank is (:func:`.forked_ranks.rank_entrypoint`): a plain run,
    such as a one-process reference, pays none of torch's imports. Returns the exit code
    a new interpreter would have."""
    from . import forked_ranks

    run = forked_ranks.rank_entrypoint(None)
    try:
        run(*args)  # prints an uncaught exception as Python does, runs the exit functions
    except SystemExit as stop:
        return _exit_code(stop)
    except BaseException:
        return 1
    return 0


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
    return 1


def _wait_for_agent(status: socket.socket, request: Mapping[str, Any], fds: Sequence[int]) -> None:
    """In the forked waiter: fork the agent, report its pid, wait, report its exit."""
    try:
        pid = os.fork()
        if pid == 0:
            status.close()
            try:
                _run_agent(request, fds)  # leaves with os._exit, unless it raised first
            except BaseException:
                traceback.print_exc()  # e.g. the job's folder is gone: a failure, never 0
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        send(status, {"pid": pid})
        _, wait_status, usage = os.wait4(pid, 0)
        send(
            status,
            {
                "returncode": os.waitstatus_to_exitcode(wait_status),
                "cpu_s": usage.ru_utime + usage.ru_stime,
            },
        )
    except OSError:
        pass  # the launcher is gone: nobody to report to
    finally:
        os._exit(0)


def serve(control: socket.socket) -> None:
    """The server's loop: import what agents need, say ``ready``, then fork a waiter
    per request until the launcher closes ``control``."""
    from . import forked_ranks

    # Importing torch._dynamo makes a cache folder in the temporary directory: make it
    # in one of the server's own and remove that, so the server leaves nothing there
    # (torch makes the folder again when something is saved in it).
    tempfile.tempdir = tempfile.mkdtemp(prefix="ddp_course_agent_server_")
    try:
        forked_ranks.preload((*_AGENT_MODULES, *forked_ranks.PRELOADED))
    finally:
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)
        tempfile.tempdir = None
    gc.freeze()  # forked agents share these pages instead of copying them
    set_command_line(sys.argv[:1] + ["-m", __spec__.name, sys.argv[1]])
    send(control, {"ready": os.getpid()})
    requests = Messages(control)
    while True:
        request = requests.read()
        if request is None:
            return
        fds, requests.fds = requests.fds, []
        status = socket.socket(fileno=fds.pop())
        if os.fork() == 0:
            control.close()
            _wait_for_agent(status, request, fds)
        status.close()
        for fd in fds:
            os.close(fd)
        while True:  # reap waiters that have finished (each lives as long as its job)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
