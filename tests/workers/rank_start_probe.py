"""Worker: what a rank's process looks like when its script starts, to compare a rank
forked from torchrun's agent with one started as a new interpreter.

``--results FILE``: rank 0 gathers every rank's view and writes it. ``--fail``: rank 1
(``--on-rank``) raises after reporting; ``--exit N``: it calls ``sys.exit(N)``;
``--exit-message TEXT``: it calls ``sys.exit(TEXT)``. At exit each rank's ``atexit``
function appends a line to ``--atexit-file``. Run as plain ``python`` (no torchrun) it is
rank 0 of 1 and reports its own view, so a plain run forked from the agent server can be
compared with one started as a new interpreter too.
"""

import sys

# Before this script imports anything: a forked rank already has torch and dynamo.
PRELOADED_AT_START = "torch._dynamo" in sys.modules

import argparse  # noqa: E402
import atexit  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402

import psutil  # noqa: E402

# What lesson 03 lists as added by torchrun, read before this script imports torch: this
# rank's variables that its agent's environment, as other processes read it, lacks.
ADDED_SINCE_AGENT = sorted(set(os.environ) - set(psutil.Process().parent().environ()))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_course.runtime import distributed  # noqa: E402
from ddp_course.tools.records import write_results  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--results")
parser.add_argument("--atexit-file", required=True)
parser.add_argument("--fail", action="store_true")
parser.add_argument("--exit", type=int)
parser.add_argument("--exit-message")
parser.add_argument("--on-rank", type=int, default=1, help="the rank that fails or exits")
args = parser.parse_args()
# The ports this process listens on before it opens any: a forked rank must not show
# the agent's store sockets as its own.
LISTENING_AT_START = [
    c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
]


def _agent_command() -> dict[str, bool]:
    # Found by its command line, as the launcher's stack dumps and the lessons find it.
    cmdline = psutil.Process().parent().cmdline()
    return {
        "loopback": "ddp_course.harness.loopback" in cmdline,
        "script": os.path.abspath(sys.argv[0]) in cmdline,
    }


def say_goodbye(rank: int) -> None:
    with open(args.atexit_file, "a") as f:
        f.write(f"rank {rank} ran its atexit function\n")


with distributed() as ctx:
    atexit.register(say_goodbye, ctx.rank)
    view = {
        "preloaded_at_start": PRELOADED_AT_START,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "tempdir": tempfile.gettempdir(),
        "store_class": dist.TCPStore.__name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "name": __name__,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_python": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "root_handlers": len(logging.root.handlers),
        "listening_at_start": LISTENING_AT_START,
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        "device_env": os.environ.get("DDP_COURSE_DEVICE"),
        "cwd": os.getcwd(),
        "agent_command": _agent_command(),
        "added_since_agent": ADDED_SINCE_AGENT,
        "agent_ancestors": [p.pid for p in psutil.Process().parent().parents()[:2]],
    }
    views = [view]
    if dist.is_initialized():
        views = [None] * ctx.world_size
        dist.all_gather_object(views, view)
    write_results(ctx, args.results, {"views": views})
    if ctx.rank == args.on_rank and args.fail:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    if ctx.rank == args.on_rank and args.exit is not None:
        sys.exit(args.exit)
    if ctx.rank == args.on_rank and args.exit_message is not None:
        sys.exit(args.exit_message)
