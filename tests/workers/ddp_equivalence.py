"""Worker: DDP on N ranks with batch b per rank against one model with batch N*b.

Every rank also trains a plain reference model on the whole global batch, so
the comparison happens inside the job, step by step. Ranks initialise their
DDP models with different seeds on purpose: DDP must broadcast rank 0's
parameters at construction.
"""

import dataclasses

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.data import synthetic_classification
from ddp_course.models import MLP
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results
from ddp_course.training import evaluate

args = worker_checks.parse_args(steps=5, batch_size=4)

with distributed() as ctx:
    n, b = ctx.world_size, args.batch_size
    torch.manual_seed(0)
    reference = MLP(in_features=20, hidden=32, num_classes=5).to(ctx.device)
    torch.manual_seed(1000 + ctx.rank)  # different on every rank
    local = MLP(in_features=20, hidden=32, num_classes=5).to(ctx.device)
    if ctx.rank == 0:
        local.load_state_dict(reference.state_dict())
    model = DDP(local, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    broadcast_ok = all(
        torch.equal(p, q) for p, q in zip(model.module.parameters(), reference.parameters())
    )

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    opt, ref_opt = sgd(model.parameters()), sgd(reference.parameters())
    gen = torch.Generator().manual_seed(123)
    max_diff = 0.0
    for _ in range(args.steps):
        x = torch.randn(n * b, 20, generator=gen).to(ctx.device)
        y = torch.randint(0, 5, (n * b,), generator=gen).to(ctx.device)
        mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
        for m, o, xs, ys in ((model, opt, x[mine], y[mine]), (reference, ref_opt, x, y)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(xs), ys).backward()
            o.step()
        for p, q in zip(model.module.parameters(), reference.parameters()):
            max_diff = max(max_diff, (p - q).abs().max().item())
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    # Exact evaluation: 53 samples do not divide by 2 or 3.
    data = synthetic_classification(53, (20,), num_classes=5, seed=4)
    distributed_eval = evaluate(model.module, data, ctx, batch_size=8)
    gathered = [None] * n
    dist.all_gather_object(gathered, distributed_eval)
    if ctx.is_main:
        single = evaluate(
            reference, data, dataclasses.replace(ctx, rank=0, world_size=1, backend=None)
        )
        write_results(
            ctx,
            args.results,
            {
                "world_size": n,
                "broadcast_ok": broadcast_ok,
                "max_diff": max_diff,
                "eval_per_rank": gathered,
                "eval_single": single,
            },
        )
