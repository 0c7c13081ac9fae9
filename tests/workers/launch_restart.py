"""Worker for the launcher's tests: rank 1 fails on the first attempt only, so a
job launched with ``--max-restarts=1`` succeeds on its second attempt.

Runs as ``torchrun --nproc_per_node=2 --max-restarts=1 tests/workers/launch_restart.py``.
"""

import argparse
import os

import torch
import torch.distributed as dist

from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

parser = argparse.ArgumentParser()
parser.add_argument("--results")
args = parser.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with distributed() as ctx:
    if attempt == 0 and ctx.rank == 1:
        raise RuntimeError("deliberate failure on the first attempt")
    total = torch.tensor([ctx.rank + 1.0])
    if ctx.is_distributed:
        dist.all_reduce(total)
    write_results(ctx, args.results, {"attempt": attempt, "sum_of_ranks_plus_one": total.item()})
