"""Lesson 06: uneven inputs hang DDP; the Join context manager fixes it.

    torchrun --nproc_per_node=2 scripts/06_uneven_inputs.py --timeout 5  # times out
    torchrun --nproc_per_node=2 scripts/06_uneven_inputs.py --join --results 06_join.json
    python scripts/06_uneven_inputs.py  # one rank: nothing is uneven

Rank r trains on `batches + r * extra` batches, as when each rank reads a
shard of its own and the shards differ in size. DDP's backward pass is a
collective (an all-reduce of the gradients): once the rank with fewer
batches leaves the loop and calls another collective, its peer's
all-reduce and that collective wait for each other forever. --timeout turns
the wait into an error. Under Join, a rank that ran out of data shadows the
others' all-reduces with zeros until every rank is done, then the final
model is broadcast from the last rank to finish (RFC pytorch#38174;
https://pytorch.org/tutorials/advanced/generic_join.html).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from ddp_course.data import synthetic_classification
from ddp_course.engine import write_results
from ddp_course.models import MLP
from ddp_course.runtime import barrier, distributed, get_logger, seed_everything


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4, help="batches on rank 0")
    parser.add_argument("--extra", type=int, default=2, help="more batches per higher rank")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step per rank")
    parser.add_argument("--join", action="store_true", help="train inside Join([model])")
    parser.add_argument("--timeout", type=float, default=60, help="collective timeout, seconds")
    parser.add_argument("--seed", type=int, default=0, help="the same on every rank")
    parser.add_argument("--results", help="rank 0 writes a JSON summary here")
    args = parser.parse_args()

    with distributed(timeout_s=args.timeout) as ctx:
        log = get_logger(ctx)
        seed_everything(args.seed)
        data = synthetic_classification(64 * args.batch_size, seed=args.seed)
        num_batches = args.batches + ctx.rank * args.extra
        start = ctx.rank * 16 * args.batch_size
        shard = Subset(data, range(start, start + num_batches * args.batch_size))
        model = MLP().to(ctx.device)
        if ctx.is_distributed:
            model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        log.info(f"rank r has {args.batches} + r*{args.extra} batches; join={args.join}")

        steps = 0
        # NEW: Join makes a rank that ran out of data answer its peers' all-reduces.
        with Join([model], enable=args.join and ctx.is_distributed):
            for x, y in DataLoader(shard, batch_size=args.batch_size):
                x, y = x.to(ctx.device), y.to(ctx.device)
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                steps += 1
        log.warning(f"left the training loop after {steps} steps")
        # Any collective after the loop (a checkpoint's barrier, evaluation's
        # all-reduce) meets the ranks that are still in backward's all-reduce.
        barrier(ctx)

        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        per_rank = [None] * ctx.world_size if ctx.is_distributed else [None]
        if ctx.is_distributed:
            dist.all_gather_object(per_rank, {"steps": steps, "checksum": checksum})
        else:
            per_rank = [{"steps": steps, "checksum": checksum}]
        log.info(
            f"steps per rank {[r['steps'] for r in per_rank]}, parameter checksums "
            f"{[round(r['checksum'], 6) for r in per_rank]}"
        )
        write_results(
            ctx, args.results, {"world_size": ctx.world_size, "join": args.join, "ranks": per_rank}
        )


if __name__ == "__main__":
    main()
