"""Results of a benchmark as files: the run's metadata (machine, versions, load, command)
and the rows, written as JSON and CSV, read back."""

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

import numpy as np
import torch


def run_metadata(command: Sequence[str] | None = None) -> dict[str, object]:
    """What a result needs to be compared and re-measured: machine, versions, load, command.

    Args:
        command: the command line; default ``sys.argv`` with ``python`` in
            front, or ``torchrun --nproc_per_node=N`` under torchrun; paths
            shown relative to the current folder when inside it.

    Returns:
        JSON-ready dict: ``machine`` (architecture, processor count, OS),
        ``python``, ``torch``, ``numpy``, ``cuda`` (None on CPU), ``gpu``
        (name or None), ``load_average_1min`` (None where the OS has none),
        ``threads_per_rank`` (``torch.get_num_threads()``),
        ``omp_num_threads`` (the variable, or None), ``command`` and
        ``utc`` (ISO 8601 seconds).
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
        if path.is_absolute() and path.is_relative_to(cwd):
            part = str(path.relative_to(cwd))
        shown.append(part)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "os": platform.system()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": gpu,
        "load_average_1min": load,
        "threads_per_rank": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "command": shlex.join(shown),
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_records(
    path: str | os.PathLike,
    rows: Sequence[Mapping[str, object]],
    meta: Mapping[str, object],
    **extra: object,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``rows`` as ``<path>.json`` (with ``meta`` and ``extra``) and ``<path>.csv``.

    The JSON file is ``{"meta": meta, "rows": rows, **extra}``; the CSV has
    one line per row, the union of the rows' keys as columns (in order of
    first appearance), and the metadata's ``command`` and
    ``load_average_1min`` in every line, so a spreadsheet keeps them too.

    Args:
        path: file name with or without suffix; ``.json`` and ``.csv``
            are written next to each other (folders are created).
        rows: flat records (numbers and strings).
        meta: from :func:`run_metadata`.
        **extra: more JSON values (fits, ratios) for the JSON file.

    Returns:
        The two paths written.

    Raises:
        ValueError: ``rows`` is empty or a row holds a list or dict.
    """
    if not rows:
        raise ValueError("no rows to write")
    base = pathlib.Path(path)
    if base.suffix in (".json", ".csv"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (list, dict)):
                raise ValueError(f"row field {k!r} is not flat: {v!r}")
            if k not in columns:
                columns.append(k)
    json_path, csv_path = base.with_name(base.name + ".json"), base.with_name(base.name + ".csv")
    record = {"meta": dict(meta), "rows": [dict(r) for r in rows], **extra}
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, "command", "load_average_1min"])
        writer.writeheader()
        for row in rows:
            load = meta.get("load_average_1min")
            writer.writerow({**row, "command": meta.get("command"), "load_average_1min": load})
    return json_path, csv_path


def read_records(path: str | os.PathLike) -> dict[str, object]:
    """Read what :func:`write_records` wrote (the ``.json`` file).

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
