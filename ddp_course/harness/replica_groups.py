"""Several replica groups at once: one torchrun job per group, on one machine.

A fault-tolerant job in torchft's style (https://github.com/pytorch/torchft) is not one
torchrun job but one per **replica group**, each with its own ``--max-restarts``: when
a group fails, torchrun restarts that group alone while the others train on, and the
restarted group joins them again through the Lighthouse. On a cluster each group runs
on its own machines::

    torchrun --nproc_per_node=8 --max-restarts=10 train.py --replica-id 0   # group 0
    torchrun --nproc_per_node=8 --max-restarts=10 train.py --replica-id 1   # group 1

:func:`torchrun_replica_groups` starts those jobs here at the same time, each through
:func:`ddp_course.harness.launch.torchrun` (loopback-only stores, per-rank logs, a
timeout that kills the job, a failure that names the rank), and waits for all of them.
"""

from __future__ import annotations

import os
import shlex
import threading
import time
from collections.abc import Mapping, Sequence

from ..runtime import DEVICE_ENV
from . import launch
from .jobs import check_script, shown_path

__all__ = ["REPLICA_GROUPS_DEVICE", "REPLICA_GROUPS_REASON", "torchrun_replica_groups"]

#: The device type of every replica group of :func:`torchrun_replica_groups`, whatever GPUs
#: this machine has; torchft's process group is then gloo.
REPLICA_GROUPS_DEVICE = "cpu"

#: Why, in one sentence for a learner.
REPLICA_GROUPS_REASON = (
    "the replica groups share this machine, each group's rank 0 would take cuda:0, and "
    "NCCL refuses two ranks of one communicator on one GPU; on a cluster each group has "
    "its own machines"
)


def torchrun_replica_groups(
    script: str | os.PathLike,
    args: Sequence[str],
    group_args: Sequence[Sequence[str]],
    env: Mapping[str, str] | None = None,
    nproc: int = 1,
    max_restarts: int = 1,
    timeout_s: float = 300.0,
    results: bool = True,
) -> list[launch.LaunchResult]:
    """Run one torchrun job per replica group, all at once, and wait for every one.

    Prints what runs first: one line on the device (:data:`REPLICA_GROUPS_REASON`) and
    each group's command as a learner would type it on that group's machine, in group
    order; then one closing line. Every group runs on the CPU with gloo and, unless
    ``env`` says otherwise, one thread per process (``OMP_NUM_THREADS=1``: the groups
    share this machine's cores, as torchrun's ranks of one job do).

    Args:
        script: the training script.
        args: its arguments, the same for every group.
        group_args: per group, more arguments (``["--replica-id", "0"]``, ...); one
            entry per group.
        env: more environment variables for every group (``TORCHFT_LIGHTHOUSE``).
        nproc: ranks per group.
        max_restarts: torchrun's ``--max-restarts`` of each group: how often a failed
            group is started again.
        timeout_s: wall-clock limit of each group's job, in seconds.
        results: pass each group ``--results <file>`` and return its JSON.

    Returns:
        One :class:`~ddp_course.harness.launch.LaunchResult` per group, in group order.

    Raises:
        FileNotFoundError: ``script`` does not exist.
        ValueError: no group, or ``env`` asks for another device than the CPU.
        LaunchError, LaunchTimeout: a group failed after its restarts, or ran past
            ``timeout_s`` (the first such group's error, raised once every group has
            ended: the others are waited for, never left running).
    """
    check_script(script)
    if not group_args:
        raise ValueError("give at least one replica group (one entry of group_args)")
    caller_env = env
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    device = env.setdefault(DEVICE_ENV, REPLICA_GROUPS_DEVICE)
    if device != REPLICA_GROUPS_DEVICE:
        raise ValueError(
            f"replica groups run on {REPLICA_GROUPS_DEVICE!r}, not {device!r}: "
            f"{REPLICA_GROUPS_REASON}"
        )
    extra = [f"--max-restarts={max_restarts}"]
    print(f"{len(group_args)} replica groups on the CPU with gloo: {REPLICA_GROUPS_REASON}")
    # What a learner types on each group's machines: the caller's variables (the
    # Lighthouse's address), not the ones every group here gets for sharing one machine.
    shown_env = [f"{k}={v}" for k, v in (caller_env or {}).items()]
    for i, own in enumerate(group_args):
        shown = shlex.join(
            [*shown_env, "torchrun", f"--nproc_per_node={nproc}", *extra, shown_path(script)]
            + [*args, *own]
        )
        print(f"[group {i}] $ {shown}", flush=True)

    outcomes: list[launch.LaunchResult | BaseException | None] = [None] * len(group_args)

    def run(i: int) -> None:
        try:
            outcomes[i] = launch.torchrun(
                script,
                [*args, *group_args[i]],
                nproc=nproc,
                timeout_s=timeout_s,
                env=env,
                results=results,
                echo=False,
                extra_torchrun_args=extra,
                announce=False,
            )
        except BaseException as exc:  # handed to the caller once every group has ended
            outcomes[i] = exc

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(group_args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    name = os.path.basename(os.fspath(script))
    print(
        f"{name}: {len(group_args)} replica groups finished in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    return [o for o in outcomes if isinstance(o, launch.LaunchResult)]
