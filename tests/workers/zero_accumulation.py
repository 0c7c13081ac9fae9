"""Worker: ZeRO stages 1-3 with gradient accumulation against DDP and one process.

Each step every rank runs ``--micro`` micro-batches of ``--batch-size`` samples,
one backward each (loss / micro), then one optimizer step. DDP all-reduces on
every backward and ``.grad`` adds up; stages 2 and 3 reduce-scatter on every
backward, so each rank's gradient *shard* must add up too. One process takes
the whole global batch at once. SGD without momentum: its step is lr x
gradient, so a micro-batch's gradient lost or counted twice changes the
parameters (Adam would divide most of it away). Two broken variants overwrite
the shard's gradient instead of adding to it.

Rank 0 writes, per variant, the largest parameter gap to DDP, and DDP's gap
to the one-process run and how far DDP moved the parameters:

    torchrun --nproc_per_node=2 tests/workers/zero_accumulation.py --results r.json
"""

import torch
import torch.nn.functional as F
import worker_checks  # tests/workers/, the script's folder
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.models import MLP
from ddp_course.runtime import distributed, no_tf32
from ddp_course.sharding import ZeRO
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(
    steps=3,
    micro=2,  # backward passes per step
    batch_size=4,  # samples per micro-batch
    lr=0.1,
)


class OverwriteZero(ZeRO):
    """Broken: each backward's shard gradient replaces the previous one (last micro-batch wins)."""

    def _accumulate(self, sharded, shard_grad):
        sharded.shard.grad = shard_grad


VARIANTS = {
    "stage1": (ZeRO, 1),
    "stage2": (ZeRO, 2),
    "stage3": (ZeRO, 3),
    "stage2-overwrite": (OverwriteZero, 2),
    "stage3-overwrite": (OverwriteZero, 3),
}


def new_model(ctx, seed):
    torch.manual_seed(seed)
    return MLP(in_features=20, hidden=32, num_classes=5).to(ctx.device)


def global_batches(ctx):
    """Per step: the whole batch, [world * micro * b] samples, rank r's micro-batch i at
    rows (r * micro + i) * b onwards."""
    gen = torch.Generator().manual_seed(123)
    count = ctx.world_size * args.micro * args.batch_size
    for _ in range(args.steps):
        x = torch.randn(count, 20, generator=gen).to(ctx.device)
        y = torch.randint(0, 5, (count,), generator=gen).to(ctx.device)
        yield x, y


def my_micro_batches(ctx, x, y):
    b = args.batch_size
    for i in range(args.micro):
        start = (ctx.rank * args.micro + i) * b
        yield x[start : start + b], y[start : start + b]


def train(ctx, model, step, zero_grad):
    for x, y in global_batches(ctx):
        zero_grad()
        for xm, ym in my_micro_batches(ctx, x, y):
            # mean over the micro-batches: every sample weighs the same as in one process
            (F.cross_entropy(model(xm), ym) / args.micro).backward()
        step()


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params.values()])


with distributed() as ctx:
    no_tf32()  # one process, DDP and ZeRO compared to float32 rounding, also on a GPU
    start = {k: p.detach().clone() for k, p in new_model(ctx, 1000).named_parameters()}

    # One process, the whole global batch per step (every rank computes it alone).
    single = new_model(ctx, 1000)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    for x, y in global_batches(ctx):
        opt.zero_grad()
        F.cross_entropy(single(x), y).backward()
        opt.step()
    single_params = {k: p.detach() for k, p in single.named_parameters()}

    # DDP: ranks start elsewhere on purpose (the constructor broadcasts rank 0's weights).
    ddp = DDP(new_model(ctx, 1000 + ctx.rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    train(ctx, ddp, opt.step, opt.zero_grad)
    reference = {k: p.detach() for k, p in ddp.module.named_parameters()}

    out = {
        "world_size": ctx.world_size,
        "micro": args.micro,
        "ddp_moved": (flat(reference) - flat(start)).abs().max().item(),
        "ddp_vs_single": (flat(reference) - flat(single_params)).abs().max().item(),
    }
    for name, (cls, stage) in VARIANTS.items():
        zero = cls(new_model(ctx, 1000 + ctx.rank), torch.optim.SGD, stage, lr=args.lr)
        train(ctx, zero, zero.step, zero.zero_grad)
        full = zero.full_parameters()
        out[name] = (flat(full) - flat(reference)).abs().max().item()
    write_results(ctx, args.results, out)
