"""DDP from scratch: average_gradients, NaiveDDP and BucketedDDP against torch's DDP.

Run from the repository root:
    python scripts/07_ddp_from_scratch.py
    torchrun --nproc_per_node=2 scripts/07_ddp_from_scratch.py --steps 3
    torchrun --nproc_per_node=2 scripts/07_ddp_from_scratch.py --parts timeline

Every rank trains each from-scratch version next to torch's DDP, from the same
start on the same data, and reports the largest parameter difference
(compare). Then it times one backward pass per rank (gradients ready, each
bucket's all-reduce) for one bucket per parameter, buckets reduced after
backward, and buckets overlapped with backward (timeline); and it runs
gradient accumulation with no_sync right and wrong (accumulation). --parts
picks some of the three. Rank 0 writes what ran to --results as JSON.

Models and batches live on ctx.device (cuda:<local rank> with nccl, else
cpu with gloo). On a GPU the timeline's times are host times: when a hook ran
and when an all-reduce was queued; with nccl, "done" is when the result may
be used by the next kernels on the stream, not when the GPU finished it.
"""

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.ddp import BucketedDDP, NaiveDDP, average_gradients
from ddp_course.harness.script_args import script_parser
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed, get_logger, no_tf32
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

PARTS = ("compare", "timeline", "accumulation")


def parse_args():
    meaning = {"steps": "SGD steps per comparison", "hidden": "width of the layer stack"}
    p = script_parser(__doc__, steps=3, batch_size=32, hidden=256, results=None, help=meaning)
    p.add_argument("--layers", type=int, default=8, help="hidden layers (2 tensors each)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.5, help="bucket capacity, MB")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="what to run (default: all three)")
    return p.parse_args()


def make_model(args, seed, device):
    torch.manual_seed(seed)
    return LayerStack(784, args.hidden, args.layers, num_classes=10).to(device)  # NEW: device


def global_batches(args, world_size, steps, per_rank, device):
    gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
    n = world_size * per_rank
    # Drawn on the CPU (the same numbers on every device), then moved.
    return [(torch.randn(n, 784, generator=gen).to(device),
             torch.randint(0, 10, (n,), generator=gen).to(device))
            for _ in range(steps)]


def sync(device):
    """Wait for the GPU's queued work, so that a clock read after it means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def compare_with_torch(kind, args, ctx):
    """Largest |parameter - torch DDP's| after ``args.steps`` SGD steps."""
    reference = DDP(make_model(args, 0, ctx.device))
    # Ranks other than 0 start elsewhere on purpose: the broadcast must fix that.
    local = make_model(args, 0 if ctx.rank == 0 else 100 + ctx.rank, ctx.device)
    if kind == "average_gradients":
        with torch.no_grad():  # by hand: rank 0's parameters to everyone
            for p in local.parameters():
                dist.broadcast(p, src=0)
        model = local
    elif kind == "NaiveDDP":
        model = NaiveDDP(local)
    else:
        model = BucketedDDP(local, bucket_cap_mb=args.bucket_cap_mb)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, model)]
    b = args.batch_size
    mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
    for x, y in global_batches(args, ctx.world_size, args.steps, b, ctx.device):
        for m, opt in zip((reference, model), opts):
            opt.zero_grad()
            F.cross_entropy(m(x[mine]), y[mine]).backward()
            if kind == "average_gradients" and m is model:
                average_gradients(model)  # NEW: the one line after backward
            opt.step()
    return max_param_diff(local, reference.module)


def timeline(args, ctx, cap_mb, overlap):
    """Times (ms from the start of backward) of gradients and bucket all-reduces, this rank."""
    model = BucketedDDP(make_model(args, 0, ctx.device), bucket_cap_mb=cap_mb, overlap=overlap)
    x, y = global_batches(args, 1, 1, args.batch_size, ctx.device)[0]
    for _ in range(3):  # the last one is recorded; the first ones warm up
        loss = F.cross_entropy(model(x), y)
        sync(ctx.device)  # forward finished before the clock starts
        start = time.perf_counter()
        loss.backward()
        sync(ctx.device)  # on a GPU backward returns before its kernels have run
        stop = time.perf_counter()
    grads, names, per_bucket = [], [], {"launch": {}, "done": {}}
    for kind, where, t in model.events:
        if kind == "grad":
            grads.append(1e3 * (t - start))
            names.append(where)
        elif kind in per_bucket:
            per_bucket[kind][where] = 1e3 * (t - start)
    returned = 1e3 * (stop - start)
    buckets = range(len(model.buckets))
    return {"buckets": len(model.buckets), "backward_returned": returned, "grad": grads,
            "grad_names": names, "bucket_names": model.bucket_names(),
            "launch": [per_bucket["launch"][i] for i in buckets],
            "done": [per_bucket["done"].get(i, returned) for i in buckets]}


def accumulate(args, ctx, how, wrapper="BucketedDDP"):
    """One optimizer step from ``args.accum`` micro-batches, three ways of using no_sync.

    ``wrapper``: ``"BucketedDDP"`` or ``"torch DDP"``; the all-reduces of either are
    counted by the course's collective log, which also sees torch's C++ reducer.
    ``synced[i]``: whether micro-batch ``i``'s forward and backward communicated.
    """
    k, b = args.accum, args.batch_size
    net = make_model(args, 0, ctx.device)
    if wrapper == "BucketedDDP":
        model = BucketedDDP(net, bucket_cap_mb=args.bucket_cap_mb)
    else:
        model = DDP(net, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = global_batches(args, ctx.world_size, 1, k * b, ctx.device)[0]
    mine = torch.arange(ctx.world_size * k * b, device=ctx.device)
    mine = mine.view(ctx.world_size, k, b)[ctx.rank]
    log = CollectiveLog()
    for i in range(k):
        last = i == k - 1
        xs, ys = x[mine[i]], y[mine[i]]
        with log.recording(i):
            if how == "right":  # forward and backward inside no_sync, except the last
                with model.no_sync() if not last else contextlib.nullcontext():
                    (F.cross_entropy(model(xs), ys) / k).backward()
            elif how == "backward_only":  # forward outside: torch's DDP syncs anyway
                loss = F.cross_entropy(model(xs), ys) / k
                with model.no_sync() if not last else contextlib.nullcontext():
                    loss.backward()
            else:  # "never": the last micro-batch inside no_sync too
                with model.no_sync():
                    (F.cross_entropy(model(xs), ys) / k).backward()
    all_reduces = [c["phase"] for c in log.calls if c["op"] == "all_reduce"]
    synced = [i in all_reduces for i in range(k)]
    opt.step()
    # The same step on one process, with the whole global batch.
    single = make_model(args, 0, ctx.device)
    single_opt = torch.optim.SGD(single.parameters(), lr=0.05)
    F.cross_entropy(single(x), y).backward()
    single_opt.step()
    # How far apart the ranks' parameters are after the step.
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, flat)
    spread = max((t - everyone[0]).abs().max().item() for t in everyone)
    buckets = len(model.buckets) if wrapper == "BucketedDDP" else None
    return {"all_reduce_calls": len(all_reduces), "synced": synced,
            "buckets": buckets, "diff_single": max_param_diff(model.module, single),
            "rank_spread": spread}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        no_tf32()  # compared to 1e-5: full float32 on every side, also on a GPU
        world_size = dist.get_world_size()
        results = {"world_size": world_size, "steps": args.steps, "accum": args.accum,
                   "bucket_cap_mb": args.bucket_cap_mb, "hidden": args.hidden,
                   "layers": args.layers, "batch_size": args.batch_size}
        if "compare" in args.parts:
            diffs = {k: compare_with_torch(k, args, ctx)
                     for k in ("average_gradients", "NaiveDDP", "BucketedDDP")}
            for kind, diff in diffs.items():
                log.info(f"{kind:17s} max |param - torch DDP| after {args.steps} steps: {diff:.2e}")
            results["diffs"] = diffs
        if "timeline" in args.parts:
            timelines = {
                "per parameter": timeline(args, ctx, cap_mb=1e-9, overlap=True),
                "buckets after backward": timeline(args, ctx, args.bucket_cap_mb, overlap=False),
                "buckets overlapped": timeline(args, ctx, args.bucket_cap_mb, overlap=True),
            }
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, timelines)
            results["timelines"] = per_rank
        if "accumulation" in args.parts:
            ways = ("right", "backward_only", "never")
            results["accumulation"] = {how: accumulate(args, ctx, how) for how in ways}
            # The same three ways with torch's DDP: does its forward decide, too?
            results["accumulation_torch"] = {how: accumulate(args, ctx, how, "torch DDP")
                                             for how in ways}
            global_batch = args.batch_size * args.accum * world_size
            log.info(f"global batch = micro-batch {args.batch_size} x accumulation {args.accum} "
                     f"x world size {world_size} = {global_batch} samples per step")
        write_results(ctx, args.results, results)


if __name__ == "__main__":
    main()
