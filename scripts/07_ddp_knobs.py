"""torch's DDP knobs, run: bucket_cap_mb, broadcast_buffers, find_unused_parameters,
static_graph and gradient_as_bucket_view.

Run from the repository root:
    python scripts/07_ddp_knobs.py
    torchrun --nproc_per_node=2 scripts/07_ddp_knobs.py
    torchrun --nproc_per_node=2 scripts/07_ddp_knobs.py --unused-error   # fails on purpose

A model with a branch that forward skips, wrapped with the default
find_unused_parameters=False, fails at its second step with torch's "Expected
to have finished reduction in the prior iteration" error: the run catches it
and reports its message; with --unused-error the job fails with it.

Models and batches live on ctx.device (cuda:<local rank> with nccl, else cpu
with gloo); on a GPU the gradient_as_bucket_view experiment measures CUDA
memory (torch.cuda.memory_allocated) instead of the process's resident memory.
"""

import argparse
import gc
import inspect
import warnings

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.ddp import BucketedDDP
from ddp_course.harness.script_args import script_parser
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed, get_logger, no_tf32
from ddp_course.tools.records import write_results
from ddp_course.tools.zero_counts import storage_bytes


def parse_args():
    meaning = {"steps": "SGD steps per experiment"}
    p = script_parser(__doc__, steps=2, batch_size=16, results=None, help=meaning)
    p.add_argument("--mem-width", type=int, default=1024, help="width of the memory model")
    p.add_argument("--unused-error", action="store_true", help="reproduce the unused error")
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
    x, y = torch.randn(b, 784, generator=gen), torch.randint(0, 10, (b,), generator=gen)
    return x.to(ctx.device), y.to(ctx.device)  # NEW: drawn on the CPU, used on ctx.device


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


def logged_sizes(model, key):
    """Bucket sizes (bytes) from torch's DDP logging data: "2919464" or "1062952, 1856512"."""
    return [int(s) for s in str(model._get_ddp_logging_data().get(key, "")).split(", ") if s]


def bucket_sizes(cap_mb, ctx, args):
    """Bucket sizes in bytes: torch's DDP (first iteration, and as rebuilt) and BucketedDDP.

    ``cap_mb=None`` leaves torch's and BucketedDDP's default (25 MB).
    """
    torch.manual_seed(0)
    three_steps = argparse.Namespace(**{**vars(args), "steps": 3})
    net = LayerStack(784, 256, 8).to(ctx.device)
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    model = DDP(net, **kwargs)
    first = logged_sizes(model, "bucket_sizes")  # the buckets of the first iteration
    model = train(model, ctx, three_steps)
    # torch rebuilds the buckets after the first iteration, in the order the
    # gradients arrived, and logs their sizes in a later forward.
    rebuilt = logged_sizes(model, "rebuilt_bucket_sizes")
    net = LayerStack(784, 256, 8).to(ctx.device)
    ours = BucketedDDP(net, **kwargs).bucket_bytes()
    param_bytes = [storage_bytes([p]) for p in net.parameters()]
    return {"torch_first_iteration": first, "torch": rebuilt, "ours": ours,
            "parameter_bytes": param_bytes}


def buffers_experiment(keyword, value, ctx, args, wrapper=DDP):
    """BatchNorm statistics per rank: right after DDP's construction, and after training.

    ``keyword`` is ``"broadcast_buffers"`` or ``"forward_sync_buffers"`` (torch
    2.13 and later), passed to DDP with ``value``. Each rank's running mean
    starts at its rank number, so ``init_equal`` tells whether the
    constructor broadcast rank 0's buffers.
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    net = net.to(ctx.device)
    net[1].running_mean.fill_(float(ctx.rank))  # rank-local buffers before wrapping
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = wrapper(net, **{keyword: value})
    deprecated = any(issubclass(w.category, FutureWarning) and keyword in str(w.message)
                     for w in caught)
    init_equal = same_on_every_rank(net[1].running_mean, ctx.world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x, y = batch(ctx, args.batch_size, step)
        x = x + ctx.rank  # ranks see different distributions: their statistics differ
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    probe = torch.ones(4, 784, device=ctx.device)
    with torch.no_grad():
        out = model(probe)  # when buffers are synced in forward, rank 0's go out first
    return {"keyword": keyword, "value": value, "deprecation_warning": deprecated,
            "init_equal": init_equal,
            "running_mean_equal": same_on_every_rank(net[1].running_mean, ctx.world_size),
            "eval_output_equal": same_on_every_rank(out, ctx.world_size)}


def buffer_settings():
    """(label, keyword, value) of the buffer-sync settings this torch accepts.

    torch 2.13 deprecated ``broadcast_buffers`` for ``forward_sync_buffers``
    (read ``inspect.signature(DDP)``); older versions know only the first.
    """
    settings = [("broadcast_buffers=True", "broadcast_buffers", True),
                ("broadcast_buffers=False", "broadcast_buffers", False)]
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        settings += [("forward_sync_buffers=True", "forward_sync_buffers", True),
                     ("forward_sync_buffers=False", "forward_sync_buffers", False)]
    return settings


def unused_with_defaults(ctx, args):
    """TwoHeads under DDP's defaults, head_a only, two steps: the second one raises.

    head_b never gets a gradient, so the first step's reduction never finishes;
    the next forward raises RuntimeError on every rank before any collective.
    """
    torch.manual_seed(0)
    two_steps = argparse.Namespace(**{**vars(args), "steps": 2})
    train(DDP(TwoHeads().to(ctx.device)), ctx, two_steps, head="a")


def unused_on_some_ranks(ctx, args):
    """BucketedDDP and torch's DDP, find_unused_parameters=True, heads used per rank and step.

    Rank r uses head_a when (r + step) is even, head_b otherwise, so in every
    step each head is used on some ranks and unused on others (with 2 ranks
    or more); an unused rank's bucket slot must count as zero. Returns the
    largest parameter difference between the two after the steps.
    """
    models = []
    for wrap in (BucketedDDP, DDP):
        torch.manual_seed(0)
        models.append(wrap(TwoHeads().to(ctx.device), find_unused_parameters=True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(args.steps + 1):
        x, y = batch(ctx, args.batch_size, step)
        head = "a" if (ctx.rank + step) % 2 == 0 else "b"
        for model, opt in zip(models, opts):
            opt.zero_grad()
            F.cross_entropy(model(x, head=head), y).backward()
            opt.step()
    ours, theirs = (m.module for m in models)
    return max((p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters()))


def memory_used(device):
    """Bytes in use where the gradients live: CUDA memory allocated, or the process's RSS."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def memory_growth_mb(as_view, ctx, args):
    """Memory growth (MB) from building DDP through one step, with or without views."""
    gc.collect()
    torch.manual_seed(0)
    net = LayerStack(784, args.mem_width, 8).to(ctx.device)
    before = memory_used(ctx.device)  # the parameters are not part of the growth
    params_mb = storage_bytes(net.parameters()) / 2**20
    model = DDP(net, gradient_as_bucket_view=as_view)
    x, y = batch(ctx, 4, 0)
    F.cross_entropy(model(x), y).backward()
    grown = (memory_used(ctx.device) - before) / 2**20
    grad_storages = {p.grad.untyped_storage().data_ptr() for p in net.parameters()}
    del model, net
    gc.collect()
    where = "CUDA memory allocated" if ctx.device.type == "cuda" else "process RSS"
    return {"memory_growth_mb": grown, "measured": where, "params_mb": params_mb,
            "grad_storages": len(grad_storages)}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        no_tf32()  # BucketedDDP against torch's DDP to 1e-5: full float32, also on a GPU
        n = dist.get_world_size()
        if args.unused_error:
            unused_with_defaults(ctx, args)  # fails on purpose
            return
        results = {"world_size": n}
        results["buckets"] = {str(cap): bucket_sizes(cap, ctx, args) for cap in (0.25, 1.0, None)}
        for cap, sizes in results["buckets"].items():
            log.info(f"bucket_cap_mb={cap}: {len(sizes['torch'])} buckets of {sizes['torch']} B")
        # find_unused_parameters=True: torch's first iteration does not use one bucket.
        torch.manual_seed(0)
        unused_first = DDP(LayerStack(784, 256, 8).to(ctx.device), find_unused_parameters=True)
        results["find_unused_first_iteration"] = logged_sizes(unused_first, "bucket_sizes")
        del unused_first
        results["buffers"] = {
            label: buffers_experiment(keyword, value, ctx, args)
            for label, keyword, value in buffer_settings()
        }
        # BucketedDDP's broadcast_buffers, the same experiment.
        results["buffers_bucketed"] = {
            f"broadcast_buffers={flag}": buffers_experiment(
                "broadcast_buffers", flag, ctx, args, wrapper=BucketedDDP
            )
            for flag in (True, False)
        }
        log.info(f"buffer sync: {results['buffers']}, BucketedDDP {results['buffers_bucketed']}")
        finals = {}
        for name, kwargs in (("find_unused_parameters", {"find_unused_parameters": True}),
                             ("static_graph", {"static_graph": True})):
            torch.manual_seed(0)
            net = TwoHeads().to(ctx.device)
            net = train(DDP(net, **kwargs), ctx, args, head="a").module
            finals[name] = torch.cat([p.detach().flatten() for p in net.parameters()])
            log.info(f"{name}=True: {args.steps} steps with an unused head, no error")
        results["unused_fixed"] = {
            "same_result": torch.equal(finals["find_unused_parameters"], finals["static_graph"]),
            "ranks_agree": same_on_every_rank(finals["static_graph"], n),
            "bucketed_vs_torch_some_ranks": unused_on_some_ranks(ctx, args),
        }
        results["gradient_as_bucket_view"] = {
            str(flag): memory_growth_mb(flag, ctx, args) for flag in (False, True)
        }
        log.info(f"gradient_as_bucket_view: {results['gradient_as_bucket_view']}")
        # Last: after the error this DDP model is unusable (the process group is not).
        try:
            unused_with_defaults(ctx, args)
            results["unused_error"] = None
        except RuntimeError as error:
            results["unused_error"] = str(error)
        log.info(f"unused head with the defaults: {str(results['unused_error']).splitlines()[0]}")
        write_results(ctx, args.results, results)


if __name__ == "__main__":
    main()
