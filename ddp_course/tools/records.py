"""The results file every script writes with ``--results PATH``: one JSON shape.

``{"meta": {...}, <the script's own keys>...}``, and for a sweep of measurements also
``"rows"`` (flat records) with a CSV of them beside the JSON file. ``meta`` is
:func:`run_metadata`: the machine, the versions, the load, the command, and the job's
world size, backend and device, so a result can be compared and measured again.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import pathlib
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..runtime import DistContext

__all__ = ["read_results", "run_metadata", "write_results"]


def run_metadata(
    command: Sequence[str] | None = None, ctx: DistContext | None = None
) -> dict[str, object]:
    """What a result needs to be compared and re-measured: machine, versions, load, command.

    Args:
        command: the command line; default ``sys.argv`` with ``python`` in
            front, or ``torchrun --nproc_per_node=N`` under torchrun; absolute
            paths shown relative to the current folder when inside it, else by
            their name only.
        ctx: the job's context; adds ``world_size``, ``backend`` and ``device``.

    Returns:
        JSON-ready dict: ``machine`` (architecture, processor count, OS),
        ``python``, ``torch``, ``numpy``, ``cuda`` (None on CPU), ``gpu``
        (the job's GPU, or None), ``load_average_1min`` (None where the OS has none),
        ``threads_per_rank`` (``torch.get_num_threads()``),
        ``omp_num_threads`` (the variable, or None), ``command`` and
        ``utc`` (ISO 8601 seconds); with ``ctx``, ``world_size``, ``backend``
        (None for one plain process) and ``device``.
    """
    if command is None:
        # Under torchrun, sys.argv is the script's; the launcher's line is what a reader retypes.
        nproc = os.environ.get("LOCAL_WORLD_SIZE")
        launcher = ["torchrun", f"--nproc_per_node={nproc}"] if nproc else ["python"]
        command = [*launcher, *sys.argv]
    cwd = pathlib.Path.cwd()
    shown = []
    for part in command:
        path = pathlib.Path(part)
        if path.is_absolute():
            # Never a path of this machine outside the repository (a temporary results file).
            part = str(path.relative_to(cwd)) if path.is_relative_to(cwd) else path.name
        shown.append(part)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    # The job's own device when there is one: a CPU job on a GPU machine names no GPU.
    on_gpu = ctx.device.type == "cuda" if ctx is not None else torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(ctx.device if ctx is not None else None) if on_gpu else None
    return {
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "os": platform.system()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda if on_gpu else None,
        "gpu": gpu,
        "load_average_1min": load,
        "threads_per_rank": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "command": shlex.join(shown),
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    } | (
        {}
        if ctx is None
        else {
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": str(ctx.device),
        }
    )


def write_results(
    ctx: DistContext | None,
    path: str | os.PathLike | None,
    results: Mapping[str, Any],
    rows: Sequence[Mapping[str, object]] | None = None,
    args: Mapping[str, object] | None = None,
) -> pathlib.Path | None:
    """Write a script's results on rank 0: ``{"meta": ..., **results}`` as JSON.

    ``meta`` is :func:`run_metadata` of this job. With ``rows`` (a sweep's
    measurements, flat records), the JSON file holds them as ``"rows"`` and a CSV
    file beside it (same name, ``.csv``) has one line per row: the union of the
    rows' keys as columns, in order of first appearance, plus the command and
    the load average, so a spreadsheet keeps them too. Folders are created.

    Args:
        ctx: this process's context; only rank 0 writes. None: a process
            outside :func:`ddp_course.runtime.distributed` (the caller writes from
            one rank only), with no job fields in ``meta``.
        path: the ``.json`` file (``--results``); None writes nothing.
        results: JSON values (numbers, strings, lists, dicts).
        rows: flat records for the CSV, or None.
        args: the script's parsed flags (``vars(args)``), kept as ``meta["args"]``;
            values other than numbers, strings, booleans, None and lists of them
            are written as strings.

    Returns:
        The JSON file's path on rank 0, else None.

    Raises:
        ValueError: ``results`` has a ``meta`` key (or ``rows`` while ``rows``
            is given), ``rows`` is empty, or a row holds a list or dict.
    """
    clash = ({"meta"} | ({"rows"} if rows is not None else set())) & set(results)
    if clash:
        raise ValueError(f"results may not have the keys {sorted(clash)}: the writer adds them")
    if rows is not None:
        if not rows:
            raise ValueError("no rows to write")
        for row in rows:
            for k, v in row.items():
                if isinstance(v, (list, dict)):
                    raise ValueError(f"row field {k!r} is not flat: {v!r}")
    if path is None or (ctx is not None and not ctx.is_main):
        return None
    meta = run_metadata(ctx=ctx)
    if args is not None:
        meta["args"] = {k: _json_value(v) for k, v in args.items()}
    json_path = pathlib.Path(path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    record = {"meta": meta, **results} | ({} if rows is None else {"rows": [dict(r) for r in rows]})
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    if rows is not None:
        columns: list[str] = []
        for row in rows:
            columns += [k for k in row if k not in columns]
        with open(json_path.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*columns, "command", "load_average_1min"])
            writer.writeheader()
            for row in rows:
                load = meta.get("load_average_1min")
                writer.writerow({**row, "command": meta.get("command"), "load_average_1min": load})
    return json_path


def read_results(path: str | os.PathLike) -> dict[str, object]:
    """Read what :func:`write_results` wrote (the ``.json`` file; the suffix may be left out).

    Raises:
        FileNotFoundError: no such file; run the benchmark command that
            makes it (benchmarks/README.md lists them).
    """
    p = pathlib.Path(path)
    if p.suffix != ".json":
        p = p.with_name(p.name + ".json")
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: run the command benchmarks/README.md gives for it")
    return json.loads(p.read_text())


def _json_value(value: object) -> object:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)
