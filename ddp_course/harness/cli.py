"""Command line: ``python -m ddp_course {check,course,execute,lab,gpu-check}``.

- ``check``: versions, devices, backends and the data set that will be used.
- ``course``: execute every notebook in order, headless, into ``build/``,
  with a progress bar and a pass/fail summary (exit code 1 if any failed).
- ``execute NB...``: re-execute notebooks top to bottom and store their
  outputs in place (for authors: committed outputs come from a clean run),
  with the kernel metadata JupyterLab writes, so opening them changes nothing.
- ``lab``: JupyterLab rooted at the repository, its terminals in the
  repository root with this environment's ``bin`` first on ``PATH``.
- ``gpu-check``: on a GPU machine, the GPU tests (part A), then the notebooks with a
  CUDA path at this GPU count (B), cheapest first within a time budget, the others (C)
  listed as skipped; a summary in ``benchmarks/gpu-<GPU name>/`` and a table; exit 0
  all ran and passed, 1 a failure, 2 no GPU, 3 not all of A and B ran in the budget.
  ``--dry-run`` prints the plan for 1, 2 and 4 GPUs (``--gpus N``: one count) without
  a GPU (see :mod:`ddp_course.harness.gpu_check` and :mod:`ddp_course.harness.gpu_plan`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import sys
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
# What JupyterLab writes into a notebook run with ipykernel's own kernel
# (its kernel.json); a different stored value marks the notebook modified
# as soon as it is opened.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def check() -> int:
    """Print the environment; return 1 if torch and torchvision do not work together."""
    import torch
    import torch.distributed as dist

    from ..data import has_full_mnist, load_mnist
    from ..runtime import pick_backend, pick_device

    print(f"python       {platform.python_version()}")
    print(f"torch        {torch.__version__}")
    try:
        import torchvision

        from ..models import resnet18_mnist

        resnet18_mnist()(torch.zeros(1, 1, 28, 28))
        print(f"torchvision  {torchvision.__version__} (a ResNet-18 forward pass works)")
    except Exception as exc:  # any import or operator failure means a broken pair
        print(f"torchvision  BROKEN: {type(exc).__name__}: {exc}")
        print("Reinstall with `make setup` (torch===X pins the index build).")
        return 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs         {gpus}" + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""))
    backends = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    print("backends     " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items()))
    device = pick_device()
    print(f"device       {device} -> backend {pick_backend(device)}")
    split = load_mnist("data", train=False)
    full = "in data/MNIST/raw" if has_full_mnist("data") else "not downloaded"
    print(
        f"MNIST        {split.source} by default ({len(split.dataset)} test digits); "
        f"full MNIST {full} (source='full' fetches it)"
    )
    return 0


def run_notebook(path: pathlib.Path, out: pathlib.Path, timeout_s: int) -> None:
    """Execute ``path`` top to bottom in its own folder and write it to ``out``.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised; the executed
            notebook up to that cell is still written to ``out``.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name=KERNELSPEC["name"],
        config=_kernel_config(),
        # A busy 2-core machine can take over a minute to start a kernel.
        startup_timeout=300,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()  # also stores language_info as the kernel reports it
    finally:
        nb.metadata["kernelspec"] = dict(KERNELSPEC)
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)


def _kernel_config():
    """Kernel manager settings: encrypted kernel sockets where possible.

    A kernel on plain TCP logs "Kernel is running over TCP without encryption"
    on stderr, which is this process's: once per notebook, in the middle of
    ``course``'s progress bar. With ``transport_encryption="auto"``, recent
    jupyter_client versions provision CurveZMQ keys for kernels that declare
    support (ipykernel's kernel.json does), so the warning's cause is gone.
    Without that option or without CurveZMQ in pyzmq, the kernel logs errors only.
    """
    import zmq
    from jupyter_client import KernelManager
    from traitlets.config import Config

    config = Config()
    if zmq.has("curve") and KernelManager.class_traits().get("transport_encryption"):
        config.KernelManager.transport_encryption = "auto"
    else:
        config.NotebookClient.extra_arguments = ["--log-level=ERROR"]
    return config


def course(paths: Sequence[pathlib.Path], out_dir: pathlib.Path | None, timeout_s: int) -> int:
    """Execute notebooks in order; print a summary; 0 if all passed, else 1."""
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(paths, unit="notebook")
    for path in bar:
        bar.set_description(path.name)
        out = path if out_dir is None else out_dir / path.name
        start = time.perf_counter()
        try:
            run_notebook(path, out, timeout_s)
            status = "passed"
        except Exception as exc:
            # The kernel's traceback is coloured; keep its last line, plain.
            last = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()[-1]
            status = f"FAILED: {type(exc).__name__}: {last[:200]}"
        rows.append((path.name, time.perf_counter() - start, status))
    bar.close()
    width = max(len(name) for name, _, _ in rows)
    for name, seconds, status in rows:
        print(f"{name:<{width}}  {seconds:7.1f} s  {status}")
    failed = sum(not status.startswith("passed") for _, _, status in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    if out_dir is not None:
        print(f"executed notebooks are in {out_dir}")
    return 1 if failed else 0


def lab_command(
    root: pathlib.Path,
    uid: int | None,
    shell: Sequence[str] | None,
    extra: Sequence[str] = (),
    settings: pathlib.Path | None = None,
) -> list[str]:
    """The ``jupyter lab`` command line: served from ``root``, lesson 00 open.

    Args:
        root: folder the server shows (the repository root).
        uid: effective user id; 0 (root, as in containers) adds ``--allow-root``,
            without which JupyterLab refuses to start. ``None`` on Windows.
        shell: the terminals' command (see ``lab_shell``); ``None`` keeps Jupyter's.
        extra: further options passed to JupyterLab as they are (``--port=...``).
        settings: JupyterLab's application settings folder, whose
            ``overrides.json`` sets defaults (see ``lab_settings``).
    """
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={root}",
        "--LabApp.default_url=/lab/tree/notebooks/00_course_setup.ipynb",
    ]
    if shell is not None:
        command.append(f"--ServerApp.terminado_settings=shell_command={shlex.join(shell)}")
    if settings is not None:
        command.append(f"--LabApp.app_settings_dir={settings}")
    if uid == 0:
        command.append("--allow-root")
    return [*command, *extra]


def lab_shell(root: pathlib.Path, bin_dir: pathlib.Path) -> list[str] | None:
    """The terminals' shell: bash with an rc file written to ``root/build/lab``.

    The rc file reads ``~/.bashrc``, then puts ``bin_dir`` first on ``PATH``
    (after it, so that a conda ``init`` block does not win) and changes to
    ``root``: JupyterLab opens a terminal in the file browser's folder, while
    every command a lesson gives is written for the repository root.
    Returns ``None`` where there is no bash (Windows): Jupyter's own shell,
    which inherits the server's ``PATH``.
    """
    bash = shutil.which("bash")
    if bash is None:
        return None
    rc = root / "build" / "lab" / "bashrc"
    rc.parent.mkdir(parents=True, exist_ok=True)
    rc.write_text(
        "# Written by `python -m ddp_course lab`: the course's terminal.\n"
        '[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n'
        f'export PATH={shlex.quote(str(bin_dir))}:"$PATH"\n'
        f"cd {shlex.quote(str(root))}\n"
    )
    return [bash, "--rcfile", str(rc), "-i"]


# Defaults the course sets for its JupyterLab: no "receive official Jupyter news?"
# question on the first start (the course runs offline and a learner should start on
# lesson 00, not on a pop-up). A learner's own settings still win over these.
LAB_OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}


def lab_settings(root: pathlib.Path) -> pathlib.Path:
    """Write the course's JupyterLab defaults to ``root/build/lab/settings/overrides.json``.

    Returns the folder, for ``--LabApp.app_settings_dir``
    (https://jupyterlab.readthedocs.io/en/stable/user/directories.html#overridesjson).
    """
    folder = root / "build" / "lab" / "settings"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "overrides.json").write_text(json.dumps(LAB_OVERRIDES, indent=2) + "\n")
    return folder


def lab(extra: Sequence[str]) -> int:
    """Run JupyterLab for the course until it is stopped; its exit code.

    ``PATH`` starts with this interpreter's ``bin`` folder (``.venv/bin``), so
    the terminals' ``python`` and ``torchrun`` are the course's.
    """
    import subprocess

    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        print("JupyterLab is not installed here: run `make setup` (or pip install -e '.[lab]').")
        return 1
    if not NOTEBOOKS.is_dir():
        print(f"No notebooks next to the package ({NOTEBOOKS}): install it editable from a")
        print("clone of the repository (`make setup`, or pip install -e .) and run it there.")
        return 1
    # Not resolved: .venv/bin/python is a link to the base interpreter.
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    command = lab_command(ROOT, uid, lab_shell(ROOT, bin_dir), extra, lab_settings(ROOT))
    if os.name == "posix":
        # Become JupyterLab: a SIGTERM or SIGINT sent to this process (by make, a
        # process manager, a closed terminal) reaches the server itself, which stops
        # its kernels and terminals, instead of killing a parent and leaving it behind.
        sys.stdout.flush()
        os.chdir(ROOT)
        os.execve(sys.executable, command, env)
    try:
        return subprocess.call(command, env=env, cwd=ROOT)
    except KeyboardInterrupt:
        return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_gpu_check_arguments(gpu: argparse.ArgumentParser) -> None:
    """The options of ``gpu-check`` (see :func:`run_gpu_check`)."""
    gpu.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new check after this many seconds (default 540 with 1-3 "
        "GPUs, 1800 with 4 or more; whatever runs is stopped 60 s later)",
    )
    gpu.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="results folder (default: benchmarks/gpu-<GPU name>)",
    )
    gpu.add_argument("--no-notebooks", action="store_true", help="run the GPU tests (part A) only")
    gpu.add_argument(
        "--all",
        action="store_true",
        dest="run_all",
        help="also run the notebooks without a CUDA path (part C); the default "
        "budget then fits every check",
    )
    gpu.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, order and estimated time for 1, 2 and 4 GPUs and "
        "run nothing (no GPU needed)",
    )
    gpu.add_argument(
        "--gpus",
        type=_positive,
        default=None,
        help="with --dry-run: the plan for this GPU count only",
    )


def run_gpu_check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``gpu-check`` with parsed ``args``; its exit status (see
    :mod:`ddp_course.harness.gpu_check`). ``--gpus`` without ``--dry-run`` is a usage error
    (a real run uses the GPUs this machine has)."""
    from . import gpu_check
    from .gpu_plan import PLAN_GPU_COUNTS

    if args.dry_run:
        counts = PLAN_GPU_COUNTS if args.gpus is None else (args.gpus,)
        return gpu_check.dry_run(counts, args.budget_s, args.run_all)
    if args.gpus is not None:
        parser.error("--gpus only goes with --dry-run: a real run uses this machine's GPUs")
    shown = ["python", "-m", "ddp_course", "gpu-check"]
    shown += ["--budget-s", f"{args.budget_s:g}"] if args.budget_s is not None else []
    shown += ["--no-notebooks"] if args.no_notebooks else []
    shown += ["--all"] if args.run_all else []
    out = None if args.out is None else args.out.resolve()
    return gpu_check.gpu_check(
        args.budget_s, out, not args.no_notebooks, command=shlex.join(shown), run_all=args.run_all
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddp_course COMMAND``: parse ``argv`` and run the command; its exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp_course",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="print versions, devices, backends and data")
    run = sub.add_parser("course", help="execute all notebooks into build/notebooks")
    run.add_argument(
        "notebooks", nargs="*", type=pathlib.Path, help="notebooks to run (default: all, in order)"
    )
    run.add_argument("--out", type=pathlib.Path, default=pathlib.Path("build/notebooks"))
    run.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    ex = sub.add_parser("execute", help="re-execute notebooks and store outputs in place")
    ex.add_argument("notebooks", nargs="+", type=pathlib.Path)
    ex.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    sub.add_parser(
        "lab",
        help="JupyterLab on the repository (further options go to JupyterLab)",
    )
    add_gpu_check_arguments(
        sub.add_parser(
            "gpu-check",
            help="the GPU tests, then the notebooks with a CUDA path, on this "
            "machine's GPUs (--dry-run: the plan, no GPU needed)",
        )
    )
    args, extra = parser.parse_known_args(argv)
    if args.command == "lab":
        return lab(extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "check":
        return check()
    if args.command == "gpu-check":
        return run_gpu_check(args, parser)
    if args.command == "course":
        paths = args.notebooks or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
        if not paths:
            parser.error(f"no notebooks found in {NOTEBOOKS}")
        return course(paths, args.out.resolve(), args.timeout)
    # Stored outputs: the launcher's "still running" lines are for a person waiting,
    # not for the record (DDP_COURSE_HEARTBEAT_S, see ddp_course.harness.jobs).
    os.environ.setdefault("DDP_COURSE_HEARTBEAT_S", "0")
    return course(args.notebooks, None, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
