"""Worker for the launcher's tests: fail on one rank, hang, or write results.

``--hang``: rank 0 waits in an all_reduce that the others never join; they
wait in a recv from rank 0, which never sends.
"""

import argparse

import torch
import torch.distributed as dist

from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int)
parser.add_argument("--hang", action="store_true")
parser.add_argument("--results")
args = parser.parse_args()

with distributed() as ctx:
    print(f"worker rank {ctx.rank} started", flush=True)
    if ctx.rank == args.fail_rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    if args.hang and ctx.rank == 0:
        dist.all_reduce(torch.zeros(1))
    elif args.hang:
        dist.recv(torch.zeros(1), src=0)
    if ctx.is_distributed:
        dist.barrier()
    write_results(ctx, args.results, {"world_size": ctx.world_size})
