"""Worker: a layer used on some ranks only, BucketedDDP against torch's DDP.

Launched by tests/multiprocess/test_ddp.py with 2 ranks. Rank ``r`` uses the
``extra`` layer in step ``s`` when ``USES[s][r]`` is true: every rank in step
0 (so every bucket slot holds a gradient afterwards), rank 0 only in step 1
(rank 1's slot must count as zero, not as step 0's value), no rank in step 2
(``.grad`` left as it was) and every rank again in step 3. Both wrappers start
from the same weights and see the same batches; rank 0 writes, per step, the
largest difference of every gradient and parameter from torch's to ``--results``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
import worker_checks  # tests/workers/, the script's folder
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.ddp import BucketedDDP
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

args = worker_checks.parse_args()

USES = [(True, True), (True, False), (False, False), (True, True)]  # [step][rank]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, use_extra):
        h = torch.relu(self.inp(x))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def build(device):
    torch.manual_seed(0)
    return Net().to(device)


with distributed() as ctx:
    if ctx.world_size != 2:
        raise SystemExit("run with 2 ranks: USES names 2")
    ours = BucketedDDP(build(ctx.device), bucket_cap_mb=25, find_unused_parameters=True)
    theirs = DDP(build(ctx.device), find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(ctx.rank)  # each rank its own data
    steps = []
    for uses in USES:
        x = torch.randn(4, 6, generator=gen).to(ctx.device)
        y = torch.randint(0, 3, (4,), generator=gen).to(ctx.device)
        grads = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=False)  # keep .grad tensors: stale values would show
            F.cross_entropy(model(x, uses[ctx.rank]), y).backward()
            grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
            opt.step()
        steps.append(
            {
                "uses": list(uses),
                "grad_diff": {n: (grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]},
                "extra_grad_norm": grads[1]["extra.weight"].norm().item(),
                "param_diff": max(
                    (p - q).abs().max().item()
                    for p, q in zip(ours.module.parameters(), theirs.module.parameters())
                ),
            }
        )
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, steps)
    write_results(ctx, args.results, {"per_rank": gathered})
