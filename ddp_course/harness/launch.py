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

The pieces live beside it: :mod:`.jobs` (processes), :mod:`.failures` (reading
logs), :mod:`.ports` and :mod:`.loopback` (torchrun with loopback-only stores).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .. import runtime
from ..runtime import DEVICE_ENV, device_plan
from . import agent_server, forked_ranks
from .failures import (
    LaunchError,
    LaunchTimeout,
    failing_rank,
    is_timeout,
    read_rank_logs,
    tail_traceback,
    where_stuck,
)
from .jobs import (
    HEARTBEAT_ENV,
    HEARTBEAT_S,
    check_script,
    dump_python_stacks,
    job_environment,
    kill_job,
    read_output,
    shown_path,
    start_job,
    wait_job,
)
from .loopback import agent_command
from .ports import free_port, is_multi_node, loopback_interface

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


# The agent server this process's jobs fork their agents from (started by the first
# job that can use one; see .agent_server).
_AGENTS = agent_server.ServerSlot()


@dataclasses.dataclass
class LaunchResult:
    """A finished, successful job.

    Attributes:
        returncode: always 0 (failures raise).
        output: rank 0's output as streamed (stdout and stderr).
        logs: every rank's output ``{rank: text}`` from the per-rank logs.
        results: the parsed JSON results file, or ``None``.
        wall_s: seconds from launch to exit, including process start-up.
        cpu_s: CPU seconds (user + system) of the agent and its ranks when the agent
            was forked by the agent server (:mod:`.agent_server`), else None.
    """

    returncode: int
    output: str
    logs: dict[int, str]
    results: Any
    wall_s: float
    cpu_s: float | None = None


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
    served: bool = False,
    announce: bool = True,
) -> LaunchResult:
    """Start ``cmd`` in a session of its own, stream it, wait, and judge it.

    ``shown`` is the command as a learner would type it, printed first so a
    cell that echoes nothing still says what it is waiting for. ``served``: ``cmd``
    (``python -m ddp_course.harness.loopback ARGS`` or ``python SCRIPT ARGS``) is forked
    from the agent server when the job's environment allows (:func:`_start`).
    ``announce=False`` prints neither the command nor the closing line nor heartbeats
    (a caller that runs several jobs at once says what runs itself).
    """
    if announce:
        print(f"$ {shown}", flush=True)
    start = time.perf_counter()
    proc, reader, lines = _start(cmd, env, echo, served)

    def rank_logs() -> dict[int, str]:
        return read_rank_logs(logs_path) if logs_path else {0: "".join(lines)}

    try:
        heartbeat = announce and not echo
        returncode = wait_job(proc, script.name, start, timeout_s, heartbeat=heartbeat)
    except subprocess.TimeoutExpired:
        dump_python_stacks(proc, script)
        kill_job(proc)
        reader.join(timeout=5)
        logs = rank_logs()
        raise LaunchTimeout(
            f"{script.name} ran past its {timeout_s:g} s timeout with {nproc} "
            "rank(s); every process of the job was killed. A hang usually means "
            "the ranks called different collectives or different numbers of them."
            + where_stuck(logs, script),
            None,
            -signal.SIGKILL,
            logs,
        ) from None
    finally:
        if proc.poll() is None:
            kill_job(proc)
    reader.join(timeout=5)
    wall_s = time.perf_counter() - start
    output = "".join(lines)
    logs = rank_logs()
    if returncode != 0:
        rank = failing_rank(output, logs)
        where = f"rank {rank}" if rank is not None else "an unknown rank"
        detail = tail_traceback(logs.get(rank, output) if rank is not None else output)
        raise LaunchError(
            f"{script.name} failed on {where} (exit code {returncode}).\n"
            f"--- end of {where}'s output ---\n{detail}",
            rank,
            returncode,
            logs,
            output,
        )
    data = None
    if results_path is not None:
        if not results_path.exists():
            raise LaunchError(
                f"{script.name} exited cleanly but wrote no --results file", None, 0, logs
            )
        data = json.loads(results_path.read_text())
    if announce:
        print(f"{script.name} finished in {wall_s:.1f} s", flush=True)
    return LaunchResult(returncode, output, logs, data, wall_s, getattr(proc, "cpu_s", None))


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
    fork_ranks: bool | None = None,
    announce: bool = True,
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

    A single-node job on the CPU of a machine where torch sees no GPU forks its ranks
    from torchrun's agent (``torchrun --run-path --start-method=fork``,
    :mod:`.forked_ranks`) instead of starting each as a new interpreter, as the printed
    command does, and forks the agent itself from this process's agent server
    (:mod:`.agent_server`): no process of the job then pays the seconds of CPU that
    importing torch costs; the script, its arguments, environment, logs and exit codes
    are the same. ``fork_ranks=False`` or ``DDP_COURSE_FORK_RANKS=0`` starts new
    interpreters (see :func:`.forked_ranks.enabled`); ``DDP_COURSE_AGENT_SERVER=0``
    starts only the agent as one.

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
        fork_ranks: fork the ranks from the agent (default: for a
            single-node CPU job unless ``DDP_COURSE_FORK_RANKS=0``). Pass
            ``False`` when a tool inspects the ranks from outside by their
            environment (:func:`ddp_course.tools.debug.rank_processes`).
        announce: print the command, the closing line and the heartbeats (False: a
            caller running several jobs at once, :mod:`.replica_groups`, says what runs).

    Returns:
        :class:`LaunchResult`.

    Raises:
        FileNotFoundError: if ``script`` does not exist.
        ValueError: if ``nproc`` < 1 or ``gpus`` < 0, or ``fork_ranks=True``
            for a job that is not a single-node CPU job.
        LaunchTimeout: the job ran past ``timeout_s``; all its processes
            were killed.
        LaunchError: a rank failed; the message names it and shows its
            traceback.
    """
    path = check_script(script)
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, not {nproc}")
    env, prefix = planned_env(env, nproc, gpus)
    single_node = not is_multi_node(extra_torchrun_args)
    fork_ranks = _fork_ranks(fork_ranks, env, single_node)
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
            *agent_command(agent_tmp, fork_ranks),
            f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d",
            # Port 0: the agent binds a free port itself, so no other job can take the
            # port between a check and the bind (torchrun --standalone does the same).
            "--rdzv-endpoint=127.0.0.1:0",
            *(["--local-addr=127.0.0.1"] if single_node else []),
            f"--log-dir={logs_path}",
            "--tee=3",
            "--local-ranks-filter=0",
            *extra_torchrun_args,
            str(path.resolve()),
            *args,
        ]
        if results_path is not None:
            cmd += ["--results", str(results_path)]
        shown = shlex.join(
            [
                "torchrun",
                f"--nproc_per_node={nproc}",
                *extra_torchrun_args,
                shown_path(script),
                *args,
            ]
        )
        served = fork_ranks and agent_server.enabled(env)
        return _run_job(
            cmd,
            path,
            nproc,
            timeout_s,
            env,
            echo,
            logs_path,
            results_path,
            prefix + shown,
            served,
            announce,
        )


def _start(cmd: list[str], env: Mapping[str, str], echo: bool, served: bool) -> tuple:
    """:func:`.jobs.start_job`, or the agent forked from this process's agent server
    when ``served`` and the job's environment lets it (:func:`.agent_server.servable`).
    A server that cannot start or has gone leaves the job to a new interpreter."""
    if served:
        base, full = job_environment({}), job_environment(env)
        if agent_server.servable(base, full):
            try:
                proc = _AGENTS.get(base).start(cmd, full)
            except (OSError, ValueError):
                pass
            else:
                return proc, *read_output(proc, echo)
    return start_job(cmd, env, echo)


def _fork_ranks(asked: bool | None, env: Mapping[str, str], single_node: bool) -> bool:
    """Whether a job forks its ranks from the agent: a CUDA process must not be forked
    once CUDA is initialised (nor, on a GPU machine, a CPU one: see
    :func:`.forked_ranks.possible`), and a multi-node job's agents start as torchrun's do."""
    device = env.get(DEVICE_ENV, os.environ.get(DEVICE_ENV, ""))
    possible = single_node and device == "cpu"
    if asked and not possible:
        raise ValueError(
            f"fork_ranks=True needs a single-node job on the CPU ({DEVICE_ENV}=cpu), "
            f"not {DEVICE_ENV}={device!r} on {'one node' if single_node else 'several nodes'}"
        )
    if asked and not forked_ranks.possible():
        raise ValueError(
            "fork_ranks=True needs a machine where torch sees no GPU: a rank "
            "forked after CUDA was initialised cannot use it"
        )
    if asked is None:
        return possible and forked_ranks.enabled(env)
    return asked


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

    On the CPU of a machine without a GPU the process is forked from the agent server
    that CPU jobs' agents come from (:mod:`.agent_server`), past torch's imports (about
    3 s of CPU less a run), unless ``DDP_COURSE_FORK_RANKS=0`` or
    ``DDP_COURSE_AGENT_SERVER=0``, or ``env`` sets a variable read while torch imports:
    then it starts as a new interpreter. ``cpu_s`` of the result is known when forked.

    ``logs`` of the result is ``{0: output}``. Raises as :func:`torchrun`,
    and ``ValueError`` if ``reference_for`` < 1.
    """
    path = check_script(script)
    if reference_for < 1:
        raise ValueError(f"reference_for must be at least 1, not {reference_for}")
    env, prefix = planned_env(env, reference_for, gpus)
    with tempfile.TemporaryDirectory(prefix="ddp_course_") as tmp:
        results_path = pathlib.Path(tmp, "results.json") if results else None
        cmd = [sys.executable, str(path.resolve()), *args]
        if results_path is not None:
            cmd += ["--results", str(results_path)]
        shown = prefix + shlex.join(["python", shown_path(script), *args])
        # Forked from the agent server like a CPU job's agent (not on a GPU machine).
        served = _fork_ranks(None, env, single_node=True) and agent_server.enabled(env)
        return _run_job(cmd, path, 1, timeout_s, env, echo, None, results_path, shown, served)


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
        ``(env, prefix)``: the new mapping, and the ``DDP_COURSE_DEVICE=...``
        to show in front of the command line: the value ``env`` sets, or
        ``"DDP_COURSE_DEVICE=cpu "`` on a fallback, else ``""`` (a value
        inherited from this process's environment is not shown, like any
        other variable of the shell).
    """
    env = dict(env or {})
    if DEVICE_ENV in env:
        # The caller's choice is part of the command: without it the job may run elsewhere.
        return env, f"{DEVICE_ENV}={shlex.quote(env[DEVICE_ENV])} "
    if DEVICE_ENV in os.environ:
        return env, ""
    plan = device_plan(nproc, runtime.gpu_count() if gpus is None else gpus)
    env[DEVICE_ENV] = plan.device_type
    if not plan.fallback:
        return env, ""
    print(plan.reason, flush=True)
    return env, f"{DEVICE_ENV}=cpu "
