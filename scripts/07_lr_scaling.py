"""The linear scaling rule with warm-up (Goyal et al. 2017) at world sizes 1, 2 and 4.

Run from the repository root:
    torchrun --nproc_per_node=4 scripts/07_lr_scaling.py
    python scripts/07_lr_scaling.py                 # world size 1 only

With a fixed batch per rank, N ranks make the global batch N times larger and
an epoch N times shorter in steps. Goyal et al., "Accurate, Large Minibatch
SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677): multiply the learning
rate by N, and ramp it up from the base rate over the first steps. One job
trains on sub-groups of its ranks (the first 1, 2, then 4), the same epochs each
time, with three learning-rate policies, and evaluates on the 1,000 test digits.
The model and every batch live on ctx.device (cuda:<local rank> with nccl,
else cpu with gloo).
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.data import load_mnist
from ddp_course.harness.script_args import script_parser
from ddp_course.models import MLP
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.records import write_results
from ddp_course.training import evaluate

POLICIES = ("base rate", "linear scaling", "linear scaling + warm-up")


def parse_args():
    meaning = {"epochs": "passes over the training subset", "lr": "base learning rate (one rank)"}
    p = script_parser(__doc__, epochs=1, batch_size=32, lr=0.01, results=None, help=meaning)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps of the linear ramp")
    return p.parse_args()


def learning_rate(policy, step, n, args):
    """Learning rate at ``step`` (0-based) with ``n`` ranks."""
    if policy == "base rate":
        return args.lr
    target = args.lr * n  # the linear scaling rule
    if policy == "linear scaling" or step >= args.warmup_steps:
        return target
    return args.lr + (target - args.lr) * step / args.warmup_steps  # gradual warm-up


def train(policy, n, group, ctx, args, images, labels):
    torch.manual_seed(0)
    model = DDP(MLP(784, 128, 2).to(ctx.device), process_group=group)  # NEW: on ctx.device
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    per_rank = len(images) // n
    mine = torch.arange(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    step = 0
    for epoch in range(args.epochs):
        order = mine[torch.randperm(per_rank, generator=torch.Generator().manual_seed(epoch))]
        for i in range(per_rank // args.batch_size):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            for g in opt.param_groups:
                g["lr"] = learning_rate(policy, step, n, args)
            opt.zero_grad()
            x, y = images[idx].to(ctx.device), labels[idx].to(ctx.device)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
    return model.module, step


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        images, labels = load_mnist(train=True, source="subset").tensors()
        test_set = load_mnist(train=False, source="subset").dataset
        sizes = [n for n in (1, 2, 4) if n <= ctx.world_size]
        # Every rank must create every group, even those it is not part of.
        groups = {n: dist.new_group(list(range(n))) for n in sizes}
        alone = dataclasses.replace(ctx, rank=0, world_size=1, backend=None)
        rows = []
        for n in sizes:
            for policy in POLICIES if n > 1 else POLICIES[:1]:
                if ctx.rank < n:
                    module, steps = train(policy, n, groups[n], ctx, args, images, labels)
                    if ctx.rank == 0:
                        accuracy = evaluate(module, test_set, alone)["accuracy"]
                        rows.append({"world_size": n, "policy": policy, "steps": steps,
                                     "global_batch": n * args.batch_size,
                                     "peak_lr": learning_rate(policy, 10**9, n, args),
                                     "accuracy": accuracy})
                        log.info(f"world size {n}, {policy:24s}: {steps:3d} steps, "
                                 f"test accuracy {accuracy:.3f}")
        dist.barrier()
        write_results(ctx, args.results, {"world_sizes": sizes, "epochs": args.epochs,
                                          "rows": rows})


if __name__ == "__main__":
    main()
