"""torch's DDP knobs, run: bucket_cap_mb, broadcast_buffers, find_unused_parameters,
static_graph and gradient_as_bucket_view.

Run from the repository root:
    python scripts/07_ddp_knobs.py
    torchrun --nproc_per_node=2 scripts/07_ddp_knobs.py
    torchrun --nproc_per_node=2 scripts/07_ddp_knobs.py --unused-error   # fails on purpose

With --unused-error a model with a branch that forward skips is wrapped with
the default find_unused_parameters=False; its second step fails with torch's
"Expected to have finished reduction in the prior iteration" error.
"""

import argparse
import gc
import inspect

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.ddp import BucketedDDP
from ddp_course.engine import write_results
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed, get_logger


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2, help="SGD steps per experiment")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--mem-width", type=int, default=1024, help="width of the memory model")
    p.add_argument("--unused-error", action="store_true", help="reproduce the unused error")
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


class TwoHeads(nn.Module):
    """A body and two heads; forward uses one of them, so the other gets no gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(784, 64)
        self.head_a = nn.Linear(64, 10)
        self.head_b = nn.Linear(64, 10)

    def forward(self, x, head="a"):
        h = torch.relu(self.body(x))
        return self.head_a(h) if head == "a" else self.head_b(h)


def batch(ctx, b, seed):
    gen = torch.Generator().manual_seed(seed * 100 + ctx.rank)  # each rank its own data
    return torch.randn(b, 784, generator=gen), torch.randint(0, 10, (b,), generator=gen)


def train(model, ctx, args, **forward_kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x, y = batch(ctx, args.batch_size, step)
        opt.zero_grad()
        F.cross_entropy(model(x, **forward_kwargs), y).backward()
        opt.step()
    return model


def same_on_every_rank(tensor, world_size):
    everyone = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(everyone, tensor.contiguous())
    return all(torch.equal(everyone[0], t) for t in everyone[1:])


def bucket_sizes(cap_mb, ctx, args):
    """Bucket sizes in bytes: torch's DDP (as rebuilt after its first step) and BucketedDDP."""
    torch.manual_seed(0)
    three_steps = argparse.Namespace(**{**vars(args), "steps": 3})
    model = train(DDP(LayerStack(784, 256, 8), bucket_cap_mb=cap_mb), ctx, three_steps)
    # The first step runs with provisional buckets; torch rebuilds them in the
    # order the gradients arrived and logs their sizes in a later forward.
    logged = model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
    ours = BucketedDDP(LayerStack(784, 256, 8), bucket_cap_mb=cap_mb).bucket_bytes()
    return {"torch": [int(s) for s in str(logged).split(", ") if s], "ours": ours}


def buffers_experiment(broadcast, ctx, args):
    """BatchNorm running statistics and eval outputs, per rank, after training."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers; older
    # versions know only the first name.
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        model = DDP(net, forward_sync_buffers=broadcast)
    else:
        model = DDP(net, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x, y = batch(ctx, args.batch_size, step)
        x = x + ctx.rank  # ranks see different distributions: their statistics differ
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    probe = torch.ones(4, 784)
    with torch.no_grad():
        out = model(probe)  # with broadcast_buffers, rank 0's statistics are sent first
    return {"running_mean_equal": same_on_every_rank(net[1].running_mean, ctx.world_size),
            "eval_output_equal": same_on_every_rank(out, ctx.world_size)}  # fmt: skip


def rss_growth_mb(as_view, ctx, args):
    """Resident memory growth (MB) from building DDP through one step, with or without views."""
    gc.collect()
    before = psutil.Process().memory_info().rss
    torch.manual_seed(0)
    net = LayerStack(784, args.mem_width, 8)
    params_mb = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    model = DDP(net, gradient_as_bucket_view=as_view)
    x, y = batch(ctx, 4, 0)
    F.cross_entropy(model(x), y).backward()
    grown = (psutil.Process().memory_info().rss - before) / 2**20
    grad_storages = {p.grad.untyped_storage().data_ptr() for p in net.parameters()}
    del model, net
    gc.collect()
    return {"rss_growth_mb": grown, "params_mb": params_mb, "grad_storages": len(grad_storages)}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        n = dist.get_world_size()
        if args.unused_error:
            torch.manual_seed(0)
            train(DDP(TwoHeads()), ctx, args, head="a")  # head_b never gets a gradient
            return
        results = {"world_size": n}
        results["buckets"] = {cap: bucket_sizes(cap, ctx, args) for cap in (0.25, 1.0)}
        for cap, sizes in results["buckets"].items():
            log.info(f"bucket_cap_mb={cap}: {len(sizes['torch'])} buckets of {sizes['torch']} B")
        results["broadcast_buffers"] = {
            str(flag): buffers_experiment(flag, ctx, args) for flag in (True, False)
        }
        log.info(f"broadcast_buffers: {results['broadcast_buffers']}")
        finals = {}
        for name, kwargs in (("find_unused_parameters", {"find_unused_parameters": True}),
                             ("static_graph", {"static_graph": True})):  # fmt: skip
            torch.manual_seed(0)
            net = train(DDP(TwoHeads(), **kwargs), ctx, args, head="a").module
            finals[name] = torch.cat([p.detach().flatten() for p in net.parameters()])
            log.info(f"{name}=True: {args.steps} steps with an unused head, no error")
        results["unused_fixed"] = {
            "same_result": torch.equal(finals["find_unused_parameters"], finals["static_graph"]),
            "ranks_agree": same_on_every_rank(finals["static_graph"], n),
        }
        results["gradient_as_bucket_view"] = {
            str(flag): rss_growth_mb(flag, ctx, args) for flag in (False, True)
        }
        log.info(f"gradient_as_bucket_view: {results['gradient_as_bucket_view']}")
        write_results(ctx, args.results, results)


if __name__ == "__main__":
    main()
