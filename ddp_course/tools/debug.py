"""Diagnosis helpers for distributed jobs: checks that name the epoch, parameter, rank or
collective at fault.

- :func:`repeated_orders`: epochs that saw the same sample order (a forgotten
  ``sampler.set_epoch(epoch)``; pytorch#31771).
- :func:`models_differ`: parameters and buffers whose shape or value differs
  from rank 0's (a collective; every rank gets the same answer).
- :func:`rank_processes` and :func:`py_spy_dumps`: the Python stack of every
  rank of a running (hung) job, with ``py-spy dump --pid``; :func:`ptrace_advice`
  says why the kernel may refuse it (Yama's ``ptrace_scope``) and what allows it.
- :func:`dump_flight_recorder`, :func:`read_flight_recorder` and
  :func:`first_divergence`: torch's flight recorder (on by default in torch
  2.13, ``TORCH_FR_BUFFER_SIZE`` entries, 2000 unless set) written per rank in
  the format of PyTorch's analyzer ``torchfrtrace``, read back, and the first
  collective the ranks disagree on.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import pickle
import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "dump_flight_recorder",
    "first_divergence",
    "models_differ",
    "ptrace_advice",
    "ptrace_scope",
    "py_spy_dumps",
    "rank_processes",
    "rank_spread",
    "read_flight_recorder",
    "repeated_orders",
    "state_digest",
    "tensor_digests",
]


def repeated_orders(orders: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Pairs of epochs ``(i, j)``, ``i < j``, that visited the same indices in the same order.

    With shuffling on, two epochs in the same order mean the sampler was not
    told the epoch: ``DistributedSampler`` seeds its shuffle with
    ``seed + epoch`` and ``epoch`` stays 0 unless ``set_epoch`` is called.

    Args:
        orders: ``orders[e]`` is the list of sample indices one rank drew in epoch ``e``.

    Raises:
        ValueError: fewer than two epochs.
    """
    if len(orders) < 2:
        raise ValueError(f"need the orders of at least 2 epochs, got {len(orders)}")
    seen = [tuple(o) for o in orders]
    return [(i, j) for i in range(len(seen)) for j in range(i + 1, len(seen)) if seen[i] == seen[j]]


def tensor_digests(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, sha256 of the bytes)}`` for every parameter and buffer of ``model``.

    Exact: any differing bit changes the digest (a tolerance would hide a
    model that drifted by rounding, which is still a bug in data parallelism).
    """
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        data = tensor.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8)  # the bytes, whatever the dtype
        digest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        out[name] = (tuple(data.shape), digest)
    return out


def state_digest(state: Any) -> str:
    """SHA-256 (hex) of every tensor's bytes and every other value in a nested state:
    ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``, say.

    Dicts are walked in the order of their keys as strings, lists and tuples in order;
    a tensor contributes its dtype, shape and bytes, anything else its ``repr``. Equal
    digests mean equal states to the last bit (a tolerance would hide two replicas
    that drifted by rounding).
    """
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous()
            h.update(f"{data.dtype}{tuple(data.shape)}".encode())
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(repr(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        else:
            h.update(repr(value).encode())

    walk(state)
    return h.hexdigest()


def models_differ(model: nn.Module, group: Any = None) -> dict[str, list[int]]:
    """Parameters and buffers that differ from rank 0's, with the ranks where they differ.

    A collective (``all_gather_object`` of each rank's :func:`tensor_digests`):
    call it on every rank; every rank gets the same answer. A name missing on
    some rank counts as differing there. Without a process group the answer
    is ``{}``.

    Returns:
        ``{name: [ranks whose tensor is not rank 0's]}``; empty when every
        rank holds the same model.
    """
    if not dist.is_initialized():
        return {}
    mine = tensor_digests(model)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    reference = gathered[0]
    names = sorted(set().union(*gathered), key=lambda n: (n not in reference, n))
    differ = {}
    for name in names:
        ranks = [r for r, d in enumerate(gathered) if d.get(name) != reference.get(name)]
        if ranks:
            differ[name] = ranks
    return differ


def rank_spread(tensor: torch.Tensor, group: Any = None) -> float:
    """Largest absolute difference between any rank's ``tensor`` and rank 0's.

    The numeric companion of :func:`models_differ`: how far apart replicas that
    should agree are (0.0 when every rank holds the same values). A collective
    (rank 0's tensor broadcast, the largest difference all-reduced with MAX):
    every rank calls it with a tensor of one shape and dtype, on the device its
    backend serves, and gets the same answer. Without a process group, 0.0.
    For a model, pass its parameters flattened into one tensor.
    """
    if not dist.is_initialized():
        return 0.0
    first = tensor.detach().clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    gap = (tensor.detach() - first).abs().max().reshape(1).double()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=group)
    return gap.item()


def rank_processes(marker: str) -> dict[int, psutil.Process]:
    """The worker processes of a running torchrun job, by global rank.

    A worker is a process whose command line contains ``marker`` (e.g. the
    script's name) and whose environment has ``RANK`` (torchrun sets it; the
    agent has none). The environment is ``/proc/PID/environ``, the one the process
    started with: a rank forked from the agent
    (:mod:`ddp_course.harness.forked_ranks`) is not found. Processes of other
    users or already gone are skipped.
    """
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if not any(marker in part for part in cmdline):
            continue
        try:
            rank = proc.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and rank.isdigit():
            found[int(rank)] = proc
    return found


_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def py_spy_dumps(marker: str, timeout_s: float = 30.0) -> dict[int, str]:
    """``py-spy dump --pid`` of every rank of a running job: ``{rank: stack text}``.

    py-spy (https://github.com/benfred/py-spy) reads a Python process's
    stack from outside, with no change to its code, so it works on a job that
    hangs inside a collective. ``py-spy dump`` pauses each process for the
    moment it reads the stack (its default; ``--nonblocking`` would not) and
    lets it go on afterwards.

    Raises:
        FileNotFoundError: ``py-spy`` is not installed (``pip install py-spy``).
        LookupError: no running process matches ``marker``.
        PermissionError: py-spy may not attach (Linux's ptrace rules); the
            message says why and what lets it (:func:`ptrace_advice`).
    """
    exe = shutil.which("py-spy") or _next_to_python("py-spy")
    if exe is None:
        raise FileNotFoundError("py-spy is not installed: pip install py-spy")
    procs = rank_processes(marker)
    if not procs:
        raise LookupError(
            f"no running torchrun worker has {marker!r} in its command line and RANK in the "
            "environment it started with (a rank forked from torchrun's agent has none there: "
            "start the job with launch.torchrun(..., fork_ranks=False))"
        )
    dumps = {}
    for rank, proc in sorted(procs.items()):
        done = subprocess.run(
            [exe, "dump", "--pid", str(proc.pid)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip()
            if "ermission" in message or "ptrace" in message:
                raise PermissionError(
                    f"py-spy cannot attach to rank {rank}: {message}\n{ptrace_advice()}"
                )
            raise RuntimeError(f"py-spy dump of rank {rank} failed: {message}")
        dumps[rank] = _ANSI_COLOUR.sub("", done.stdout)  # py-spy colours some terminals
    return dumps


YAMA_PTRACE_SCOPE = pathlib.Path("/proc/sys/kernel/yama/ptrace_scope")


def ptrace_scope() -> int | None:
    """This kernel's ``kernel.yama.ptrace_scope`` (0 to 3), or None without Yama."""
    try:
        return int(YAMA_PTRACE_SCOPE.read_text())
    except (OSError, ValueError):
        return None


def ptrace_advice() -> str:
    """Why a ``py-spy dump`` of another process can be refused here, and what lets it.

    Attaching needs ptrace rights over the process. A normal user has them over
    its own processes only, and Yama narrows that further: with
    ``ptrace_scope`` 1, Ubuntu's default, a process may attach only to its own
    descendants, and the ranks are torchrun's children, not py-spy's (the Linux
    kernel's Yama documentation, admin-guide/LSM/Yama). Root, or the
    ``CAP_SYS_PTRACE`` capability, may attach unless the scope is 3.
    """
    scope = ptrace_scope()
    who = "root" if os.geteuid() == 0 else "a normal user"
    rules = {
        None: "this kernel has no Yama ptrace_scope",
        0: "kernel.yama.ptrace_scope is 0: any process of the same user",
        1: "kernel.yama.ptrace_scope is 1 (Ubuntu's default): a process may attach "
        "only to its own descendants, and the ranks are torchrun's children, not py-spy's",
        2: "kernel.yama.ptrace_scope is 2: only with CAP_SYS_PTRACE (root)",
        3: "kernel.yama.ptrace_scope is 3: nobody, not even root, until a reboot",
    }
    return (
        f"Running as {who}; {rules.get(scope, f'kernel.yama.ptrace_scope is {scope}')}. "
        "To let py-spy attach: run it with sudo (sudo py-spy dump --pid PID), or allow "
        "same-user attaching until the next reboot (sudo sysctl kernel.yama.ptrace_scope=0), "
        "or in a container start it with --cap-add SYS_PTRACE. A process of another user "
        "needs root in any case."
    )


def _next_to_python(name: str) -> str | None:
    # A virtual environment's scripts sit next to its python, which is not
    # always on PATH (a Jupyter kernel started from the venv's python).
    import sys

    candidate = pathlib.Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else None


def _dump_fr() -> bytes:
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no flight recorder dump for every backend "
            "(torch._C._distributed_c10d._dump_fr_trace); use a newer torch, or the "
            "launcher's stack dumps and dist.monitored_barrier"
        )
    return dump()


def dump_flight_recorder(folder: str | os.PathLike, rank: int) -> pathlib.Path:
    """Write this rank's flight-recorder buffer to ``folder/rank_<rank>`` (a pickle).

    The recorder keeps the last ``TORCH_FR_BUFFER_SIZE`` collectives of every
    process group: 2000 by default in torch 2.13, read when the first group is
    created, 0 turns it off. PyTorch's analyzer reads one such file per rank:
    ``torchfrtrace FOLDER --prefix rank_``.

    Call it from Python, e.g. in an ``except`` around the training loop: on
    gloo a timed-out collective raises there. On nccl the watchdog thread
    aborts the process on a timeout and no ``except`` runs; set
    ``TORCH_FR_DUMP_TEMP_FILE=FOLDER/rank_`` (and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``)
    before the group is created, and the watchdog writes the same files.

    A gloo dump from torch 2.13 lists its process groups under the name ``''``
    in ``pg_config`` while its entries name the group ``'0'``; the analyzer
    then fails with ``KeyError: ('0', 0)``. The ``pg_config`` written here
    is keyed by the names the entries use, which is what the analyzer expects.

    Raises:
        RuntimeError: the recorder holds nothing (``TORCH_FR_BUFFER_SIZE=0``, a
            torch that leaves it off by default, or no collective ran yet) or
            this torch cannot dump it.
    """
    trace = pickle.loads(_dump_fr())
    entries = trace.get("entries", [])
    if not entries:
        raise RuntimeError(
            "the flight recorder holds no entries: no collective ran yet, or it is off; "
            "set TORCH_FR_BUFFER_SIZE=2000 (torch 2.13's default) in the environment of "
            "every rank before the process group is created"
        )
    old = trace.get("pg_config", {})
    config = {}
    for entry in entries:
        name, desc = entry["process_group"]
        ranks = old.get(name, old.get("", {})).get("ranks", "[]")
        config.setdefault(name, {"name": name, "desc": desc, "ranks": ranks})
    trace["pg_config"] = config
    out = pathlib.Path(folder, f"rank_{rank}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(pickle.dumps(trace))
    return out


def read_flight_recorder(folder: str | os.PathLike) -> dict[int, list[dict]]:
    """The dumps in ``folder`` (files ``rank_<r>``), as ``{rank: [entry, ...]}``.

    Each entry is shortened to ``seq`` (the collective's sequence number in
    its group), ``op`` (e.g. ``"all_reduce"``), ``sizes`` (input shapes),
    ``state`` and ``where`` (the innermost frame outside torch, ``file:line``).

    Raises:
        FileNotFoundError: no ``rank_<r>`` file in ``folder``.
    """
    files = sorted(pathlib.Path(folder).glob("rank_*"), key=lambda p: int(p.name[5:]))
    if not files:
        raise FileNotFoundError(f"no flight-recorder dump (rank_<r>) in {folder}")
    traces = {}
    for path in files:
        trace = pickle.loads(path.read_bytes())
        rows = []
        for e in trace["entries"]:
            if e.get("is_p2p"):
                continue
            frames = [f for f in e.get("frames", []) if "/torch/" not in f["filename"]]
            where = (
                f"{pathlib.Path(frames[0]['filename']).name}:{frames[0]['line']}" if frames else ""
            )
            rows.append(
                {
                    "seq": e["collective_seq_id"],
                    "op": e["profiling_name"].split(":")[-1],
                    "sizes": e["input_sizes"],
                    "state": e["state"],
                    "where": where,
                }
            )
        traces[int(path.name[5:])] = rows
    return traces


def first_divergence(traces: dict[int, list[dict]]) -> dict | None:
    """The first collective (by sequence number) the ranks do not agree on, or ``None``.

    Ranks disagree when their entries with that sequence number differ in
    operation or input sizes, or some rank has no entry with it (it never
    reached that collective).

    Returns:
        ``{"seq": n, "calls": {rank: "all_reduce [[5]] at x.py:12" or None}}``.
    """
    by_rank = {rank: {e["seq"]: e for e in entries} for rank, entries in traces.items()}
    seqs = sorted(set().union(*(d.keys() for d in by_rank.values())))
    for seq in seqs:
        calls = {r: d.get(seq) for r, d in sorted(by_rank.items())}
        kinds = {(c["op"], str(c["sizes"])) if c else None for c in calls.values()}
        if len(kinds) > 1:
            return {
                "seq": seq,
                "calls": {
                    r: f"{c['op']} {c['sizes']} at {c['where']}" if c else None
                    for r, c in calls.items()
                },
            }
    return None
