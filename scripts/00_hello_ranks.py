"""Lesson 00: every rank says hello, then the ranks agree on a sum.

python scripts/00_hello_ranks.py                      # one process
torchrun --nproc_per_node=2 scripts/00_hello_ranks.py  # two ranks
torchrun --nproc_per_node=2 scripts/00_hello_ranks.py --results hello.json
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist

from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results


def main() -> None:
    parser = argparse.ArgumentParser(description="hello from every rank")
    parser.add_argument("--results", help="rank 0 writes a JSON summary here")
    args = parser.parse_args()
    with distributed() as ctx:
        # Per-rank output is the lesson here, so every rank prints.
        print(
            f"hello from rank {ctx.rank} of {ctx.world_size} "
            f"(local rank {ctx.local_rank}, {ctx.device}, backend {ctx.backend}, "
            f"pid {os.getpid()}, host {socket.gethostname()})",
            flush=True,
        )
        # Each rank contributes its rank + 1; all_reduce sums them on every rank.
        total = torch.tensor([ctx.rank + 1], device=ctx.device)
        if ctx.is_distributed:
            dist.all_reduce(total)
        expected = ctx.world_size * (ctx.world_size + 1) // 2
        assert total.item() == expected, (total.item(), expected)
        torchrun_vars = {
            k: os.environ[k]
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")
            if k in os.environ
        }
        write_results(ctx, args.results, {"world_size": ctx.world_size, "backend": ctx.backend,
                                          "sum": total.item(), "env": torchrun_vars})


if __name__ == "__main__":
    main()
