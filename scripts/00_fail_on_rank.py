"""Lesson 00: a job in which one rank fails, to see how the failure is reported.

    torchrun --nproc_per_node=2 scripts/00_fail_on_rank.py --rank 1

The chosen rank raises; the others wait at a barrier and fail soon after
("Connection closed by peer"). ddp_course.harness.launch names the rank that failed
first and shows its traceback.
"""

import argparse

import torch.distributed as dist

from ddp_course.runtime import distributed


def main() -> None:
    parser = argparse.ArgumentParser(description="fail on one rank")
    parser.add_argument("--rank", type=int, default=1, help="the rank that raises")
    args = parser.parse_args()
    with distributed() as ctx:
        if ctx.rank == args.rank:
            raise ValueError(f"rank {ctx.rank} cannot find its data shard")
        if ctx.is_distributed:
            dist.barrier()  # the healthy ranks wait here for the one that failed


if __name__ == "__main__":
    main()
