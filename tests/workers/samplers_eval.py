"""Worker for tests/multiprocess/test_exact_eval.py: evaluate a saved model on the test
digits, exactly (ddp_course.training.evaluate) and through a padded
DistributedSampler, and write both to --results from rank 0.

    torchrun --nproc_per_node=3 tests/workers/samplers_eval.py --model m.pt --results r.json
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddp_course.checkpoint import load_checkpoint
from ddp_course.data import load_mnist
from ddp_course.models import MLP
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results
from ddp_course.training import evaluate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--results", required=True)
    args = parser.parse_args()
    with distributed() as ctx:
        model = MLP().to(ctx.device)
        load_checkpoint(args.model, model, map_location=ctx.device)
        test = load_mnist(train=False, source="subset").dataset
        exact = evaluate(model, test, ctx, batch_size=250)
        sampler = DistributedSampler(test, ctx.world_size, ctx.rank, shuffle=False)
        correct = count = 0
        with torch.no_grad():
            for x, y in DataLoader(test, batch_size=250, sampler=sampler):
                correct += int((model(x.to(ctx.device)).argmax(1).cpu() == y).sum())
                count += len(y)
        padded = [None] * ctx.world_size
        dist.all_gather_object(padded, {"correct": correct, "samples": count})
        write_results(ctx, args.results, {"exact": exact, "padded": padded})


if __name__ == "__main__":
    main()
