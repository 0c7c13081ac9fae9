r"""Step time of DDP from scratch against torch's DDP; no_sync; a bucket-size sweep.

Run from the repository root (minutes; on a quiet machine):
    torchrun --nproc_per_node=2 scripts/07_benchmark.py \
        --results benchmarks/cpu-2core/07_benchmark.json
A tiny run (seconds), also as one plain process:
    python scripts/07_benchmark.py --model layerstack --batch-size 4 --repeats 2 --caps 0.25 1

One training step (zero_grad, forward, backward, SGD step) per repeat, timed
with ddp_course.tools.bench.time_op (a barrier before each repeat, the slowest rank
counts, median and interquartile range over repeats). Reported as ratios from
the same run: NaiveDDP / BucketedDDP / torch's DDP; synchronising each of 4
micro-batches against no_sync for the first 3; and step time against
bucket_cap_mb for BucketedDDP and torch's DDP. Rank 0 writes JSON to --results
and a plot next to it (same name, .png).
"""

import pathlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from ddp_course.ddp import BucketedDDP, NaiveDDP
from ddp_course.harness.script_args import script_parser
from ddp_course.models import LayerStack, resnet18_mnist
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.bench import summarize, time_op
from ddp_course.tools.records import write_results
from ddp_course.training import sgd_step_fn

CAPS = [0.25, 0.5, 1, 2, 5, 10, 25, 50, 100]


def parse_args():
    p = script_parser(__doc__, batch_size=16, no_progress=False, results=None)
    p.add_argument("--model", choices=["resnet18", "layerstack"], default="resnet18")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each timing")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per setting")
    p.add_argument("--accum", type=int, default=4, help="micro-batches in the no_sync test")
    p.add_argument("--caps", type=float, nargs="+", default=CAPS, help="bucket_cap_mb sweep")
    return p.parse_args()


def make_model(name, device):
    torch.manual_seed(0)
    model = resnet18_mnist() if name == "resnet18" else LayerStack(784, 256, 8)
    return model.to(device)


def step_fn(model, args, device, accum=1, no_sync=False):
    """One optimizer step over ``accum`` micro-batches, as a function for time_op."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, 28, 28) if args.model == "resnet18" else (784,)
    x = torch.randn(args.batch_size, *shape, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen).to(device)
    return sgd_step_fn(model, x, y, accum=accum, no_sync=no_sync)


def timed(model, args, ctx, **kwargs):
    times = time_op(step_fn(model, args, ctx.device, **kwargs), ctx, args.warmup, args.repeats)
    t = summarize(times)
    return {"median_s": t.median, "iqr_s": t.iqr, "repeats": t.repeats}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        dev = ctx.device
        wrappers = {
            "NaiveDDP": lambda: NaiveDDP(make_model(args.model, dev)),
            "BucketedDDP": lambda: BucketedDDP(make_model(args.model, dev)),
            "torch DDP": lambda: DDP(make_model(args.model, dev)),
        }
        sweep = [("BucketedDDP", cap) for cap in args.caps] + [("torch DDP", c) for c in args.caps]
        total = len(wrappers) + 2 + len(sweep)
        bar = tqdm(total=total, disable=args.no_progress or not ctx.is_main, desc="settings")
        steps = {}
        for name, build in wrappers.items():
            steps[name] = timed(build(), args, ctx)
            bar.update()
        accumulation = {
            "sync every micro-batch": timed(DDP(make_model(args.model, dev)), args, ctx,
                                            accum=args.accum),
            "no_sync": timed(DDP(make_model(args.model, dev)), args, ctx, accum=args.accum,
                             no_sync=True),
        }
        bar.update(2)
        caps = {"BucketedDDP": {}, "torch DDP": {}}
        for name, cap in sweep:
            model = make_model(args.model, dev)
            if name == "BucketedDDP":
                wrapped = BucketedDDP(model, bucket_cap_mb=cap)
            else:
                wrapped = DDP(model, bucket_cap_mb=cap)
            caps[name][str(cap)] = timed(wrapped, args, ctx)
            bar.update()
        bar.close()
        med = {k: v["median_s"] for k, v in steps.items()}
        ratios = {
            "BucketedDDP / torch DDP": med["BucketedDDP"] / med["torch DDP"],
            "NaiveDDP / BucketedDDP": med["NaiveDDP"] / med["BucketedDDP"],
            "sync every micro-batch / no_sync": accumulation["sync every micro-batch"]["median_s"]
            / accumulation["no_sync"]["median_s"],
        }
        for k, v in ratios.items():
            log.info(f"{k}: {v:.2f}")
        params = make_model(args.model, "cpu").parameters()
        # meta: the machine, versions and load average; args: this run's flags.
        write_results(ctx, args.results, {
            "world_size": dist.get_world_size(), "device": str(dev),
            "backend": dist.get_backend(), "parameter_tensors": len(list(params)),
            "step": steps, "accumulation": accumulation, "bucket_sweep": caps,
            "ratios": ratios,
        }, args=vars(args))
        if ctx.is_main and args.results:
            plot(caps, pathlib.Path(args.results).with_suffix(".png"))


def plot(caps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, points in caps.items():
        xs = [float(c) for c in points]
        medians = [1e3 * p["median_s"] for p in points.values()]
        spreads = [1e3 * p["iqr_s"] / 2 for p in points.values()]
        ax.errorbar(xs, medians, yerr=spreads, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time, median (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
