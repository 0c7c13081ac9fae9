"""Ranks forked from torchrun's agent instead of started as new interpreters.

A rank that torchrun starts as ``python -u script.py`` spends, before its first line
of work, about 2.5 s of CPU importing torch and 1.5 s more importing
``torch._dynamo`` (the first optimizer, DDP or ``fully_shard`` does), and about 1 s
leaving; on a 2-core laptop that floor, paid by every rank of every job, is most of
what a short lesson job costs. torchrun can instead run the script in its own
interpreter, forked once per rank: ``torchrun --run-path --start-method=fork``
(``torch.distributed.run.run_script_path``, which calls ``runpy.run_path``; see
https://pytorch.org/docs/stable/elastic/run.html). :func:`prepare_agent` makes the
agent import what every rank needs first, so each forked rank starts with it
imported; :func:`rank_entrypoint` is what each rank runs.

What stays the same for the script: ``sys.argv``, ``__name__ == "__main__"``, the
environment torchrun gives every rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``OMP_NUM_THREADS``...), the per-rank logs, exit
codes and tracebacks in them, restarts. What differs: the rank's command line is the
agent's, and ``/proc/PID/environ`` shows the agent's starting environment (the
rank's ``os.environ`` is right; tools that read another process's environment, as
:func:`ddp_course.tools.debug.rank_processes` does, need ranks started as new
interpreters), and torchrun's own failure summary names only the first rank that
failed. Only the launchers use it (:func:`ddp_course.harness.launch.torchrun` and the
simulated nodes of :func:`ddp_course.harness.multinode.torchrun_nodes`), only for
jobs on the CPU (a CUDA process must not be forked after CUDA was initialised, and
GPU jobs keep torchrun's usual start), and unless ``DDP_COURSE_FORK_RANKS=0``
(:func:`enabled`).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import os
import runpy
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping

__all__ = [
    "FORK_ENV",
    "PRELOADED",
    "close_inherited_listeners",
    "enabled",
    "possible",
    "preload",
    "prepare_agent",
    "rank_entrypoint",
]

# ``DDP_COURSE_FORK_RANKS=0`` starts the ranks of CPU jobs as new interpreters (see
# :func:`enabled`).
FORK_ENV = "DDP_COURSE_FORK_RANKS"

# What the agent imports for its ranks: torch._dynamo is most of the cost (torch's
# optimizers, DDP and FSDP2 import it on first use); the rest is cheap once it is in.
PRELOADED = (
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
)

# Signals the agent handles itself (torchrun turns them into an exception that stops
# the job); a rank must die of them as a new interpreter would.
_DEFAULT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def enabled(env: Mapping[str, str]) -> bool:
    """Whether CPU jobs fork their ranks: ``DDP_COURSE_FORK_RANKS`` in ``env``, else in
    this process's environment, ``"1"`` (the default) or ``"0"``. ``0`` starts every rank
    as a new interpreter, as plain ``torchrun`` does (slower, and what to try first when a
    job behaves differently under the course's launcher than from a shell).

    Never on a machine where torch sees a GPU (:func:`possible`), whatever the setting.

    Raises:
        ValueError: the variable is set to something other than ``"0"`` or ``"1"``.
    """
    setting = env.get(FORK_ENV, os.environ.get(FORK_ENV, "1"))
    if setting not in ("0", "1"):
        raise ValueError(f"{FORK_ENV}={setting!r}: use 1 (fork the ranks) or 0")
    return setting == "1" and possible()


def possible() -> bool:
    """Whether ranks can be forked on this machine: only where torch sees no GPU.

    A process forked from one that has initialised CUDA cannot use it, not even to ask
    (https://pytorch.org/docs/stable/notes/multiprocessing.html#cuda-in-multiprocessing),
    and a CPU rank's ``torch.optim.AdamW.step`` asks: on an H200 with torch 2.11, the
    ranks of a CPU job forked from the agent failed there with ``CUDA error:
    initialization error``. So on a GPU machine the ranks of a CPU job (a fallback with
    fewer GPUs than ranks) start as new interpreters.
    """
    from ..runtime import gpu_count

    return gpu_count() == 0


def prepare_agent(tempdir: str | None) -> Callable[..., None]:
    """Import :data:`PRELOADED` in torchrun's agent and return the ranks' entry point
    (:func:`rank_entrypoint` with ``tempdir``, the ranks' ``tempfile.tempdir``).

    Call in the agent before it starts any rank. ``gc.freeze()`` moves every object
    imported so far out of the garbage collector's reach, so a rank's collections do
    not touch (and copy, page by page) the memory it shares with the agent.
    """
    preload(PRELOADED)
    gc.freeze()
    return rank_entrypoint(tempdir)


def preload(names: Iterable[str]) -> None:
    """Import the modules ``names``, leaving ``os.environ`` as it was before.

    Importing ``torch._dynamo`` sets ``TORCHINDUCTOR_CACHE_DIR`` in the environment. A
    rank started as a new interpreter has not imported it when its script starts, so a
    forked rank must not inherit the variable (lesson 03 lists what torchrun adds to a
    rank's environment); torch sets it again when it needs the folder.
    """
    before = dict(os.environ)
    for name in names:
        importlib.import_module(name)
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


def close_inherited_listeners() -> list[int]:
    """Close this process's copies of listening sockets; returns their descriptors.

    A forked process holds a copy of every descriptor its parent had open, the
    sockets of the agent's store server among them, so to ``ss`` or psutil the rank
    would listen on the agent's ports too. Closing a copy leaves the agent's own
    socket open and served. Meant for the start of a forked rank, before the script
    opens sockets of its own.
    """
    closed = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # the directory's own descriptor, or one closed meanwhile
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        if listening:
            sock.close()
            closed.append(fd)
        else:
            sock.detach()
    return closed


def rank_entrypoint(tempdir: str | None) -> Callable[..., None]:
    """``run(script, *args)``: run ``script`` as ``__main__`` in this (forked) rank.

    Before the script it undoes what the agent changed in its own process and a new
    interpreter would not have: torch's thread count (set from ``OMP_NUM_THREADS``
    as a new interpreter sets it), signal handlers, ``atexit`` functions, the copies
    of the agent's listening sockets (:func:`close_inherited_listeners`), root logging
    handlers, ``tempfile.tempdir`` (set back to ``tempdir``) and the loopback store
    class (see :mod:`.loopback`). An uncaught exception, or the message of
    ``sys.exit("message")``, is printed to the rank's log as Python would print it,
    then raised again for torchrun to report; the script's ``atexit`` functions run at
    the end, as at a normal interpreter exit.
    """

    def run(script: str, *args: str) -> None:
        import torch
        import torch.distributed as dist

        # torch sized its thread pool in the agent, before torchrun set the ranks'
        # OMP_NUM_THREADS; a new interpreter reads it at its first parallel op.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        for name in _DEFAULT_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()
        close_inherited_listeners()
        logging.root.handlers.clear()
        tempfile.tempdir = tempdir
        dist.TCPStore = getattr(dist.TCPStore, "torch_class", dist.TCPStore)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                raise
            # sys.exit("message"): Python prints it and exits with 1; here the
            # rank's log must get it before torchrun's redirection ends.
            print(stop.code, file=sys.stderr)
            raise SystemExit(1) from None
        except BaseException:
            # What Python does with an uncaught exception: torch's distributed
            # excepthook, when a process group set it, prefixes each line with the rank.
            kind, error, tb = sys.exc_info()
            tb = _from_script(tb, script)
            sys.excepthook(kind, error.with_traceback(tb), tb)  # it prints __traceback__
            raise
        finally:
            sys.stderr.flush()
            atexit._run_exitfuncs()

    return run


def _from_script(tb, script: str):
    # A new interpreter's traceback starts in the script; this one starts in run() and
    # runpy, which compiled the script under its absolute path: drop those frames, so
    # that a learner reads the traceback a plain run would print.
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename != os.path.abspath(script):
        start = start.tb_next
    return tb if start is None else start
