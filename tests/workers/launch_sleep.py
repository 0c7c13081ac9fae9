"""Worker for the launcher's tests: join the group, report the device, then sleep.

Runs as ``python tests/workers/launch_sleep.py`` and as
``torchrun --nproc_per_node=2 tests/workers/launch_sleep.py --sleep 1``.
With ``--ready-dir DIR`` each rank writes its process id to ``DIR/rank<r>`` once
every rank has joined the group, so a test can inspect a job that is running.
``--pretend-gpus N`` makes torch report N GPUs in this process (none can be
used), to test the device rule on a CPU machine.
"""

import argparse
import os
import pathlib
import time

import torch

from ddp_course.runtime import DEVICE_ENV, barrier, distributed
from ddp_course.tools.records import write_results

parser = argparse.ArgumentParser()
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep in the group")
parser.add_argument("--ready-dir", help="folder where each rank marks that it joined")
parser.add_argument("--pretend-gpus", type=int, help="GPUs torch.cuda should report")
parser.add_argument("--results")
args = parser.parse_args()
if args.pretend_gpus is not None:
    torch.cuda.is_available = lambda: args.pretend_gpus > 0
    torch.cuda.device_count = lambda: args.pretend_gpus

with distributed() as ctx:
    planned = os.environ.get(DEVICE_ENV)
    print(
        f"rank {ctx.rank}: device {ctx.device}, backend {ctx.backend}, {DEVICE_ENV}={planned}",
        flush=True,
    )
    barrier(ctx)
    if args.ready_dir:
        pathlib.Path(args.ready_dir, f"rank{ctx.rank}").write_text(str(os.getpid()))
    time.sleep(args.sleep)
    barrier(ctx)
    write_results(
        ctx,
        args.results,
        {
            "device": str(ctx.device),
            "backend": ctx.backend,
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        },
    )
