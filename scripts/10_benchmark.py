r"""Lesson 10: benchmark distributed training the way the field reports it, then model it.

Modes (one or several per run; each row of the results names its mode):
  collectives  every collective from --min-bytes to --max-bytes: algbw, busbw, alpha-beta fits
  scaling      DDP steps on 1, 2, 4 ranks (sub-groups of one job), strong and weak scaling,
               threads per rank, Amdahl and Gustafson fits
  knobs        bucket_cap_mb sweep, no_sync accumulation, fp16/bf16 compression hooks,
               lesson 07's BucketedDDP against torch's DDP
  model        t_step = t_forward + t_backward + exposed all-reduce + t_optimizer, predicted
               for N ranks from rank 0's compute alone (through BucketedDDP in a group of
               one rank, stretched where the ranks share cores) and an all-reduce fit at
               N ranks, against BucketedDDP's measured step for several bucket caps
  trace        torch.profiler traces of DDP steps: how much all-reduce time overlaps backward

Recorded runs, from the repository root (minutes each):
    torchrun --nproc_per_node=2 scripts/10_benchmark.py collectives \
        --results benchmarks/cpu-2core/10_collectives.json
    torchrun --nproc_per_node=4 scripts/10_benchmark.py scaling \
        --results benchmarks/cpu-2core/10_scaling.json
    torchrun --nproc_per_node=2 scripts/10_benchmark.py knobs model trace \
        --chrome-trace benchmarks/cpu-2core/10_trace_rank0.json \
        --results benchmarks/cpu-2core/10_knobs_model_trace.json
    torchrun --nproc_per_node=1 scripts/10_benchmark.py model \
        --results benchmarks/cpu-2core/10_model_nproc1.json
    torchrun --nproc_per_node=4 scripts/10_benchmark.py model \
        --results benchmarks/cpu-2core/10_model_nproc4.json
A tiny run of every mode (seconds), also as one plain process:
    python scripts/10_benchmark.py all --tiny
    torchrun --nproc_per_node=2 scripts/10_benchmark.py all --tiny

Method: warm-up first; every timed iteration starts at a barrier and lasts as
long as its slowest rank (one all_reduce(MAX) of the elapsed times); medians
and interquartile ranges over repeats; the settings of a mode are interleaved
repeat by repeat, in an order that rotates, so a slow spell of the machine
falls on all of them alike. Rank 0 writes the rows as JSON and CSV (same
name, .csv) with the machine, versions, load average and this command.
"""

import dataclasses
import json
import os
import pathlib
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from ddp_course.builtin_collectives import all_gather_single, reduce_scatter_single
from ddp_course.ddp import BucketedDDP
from ddp_course.harness.script_args import script_parser
from ddp_course.models import LayerStack
from ddp_course.runtime import barrier, distributed, get_logger
from ddp_course.tools.bench import (
    COLLECTIVES,
    AlphaBeta,
    algbw,
    busbw,
    busbw_plateau,
    fit_each,
    message_sizes,
    summarize,
    time_interleaved,
)
from ddp_course.tools.records import write_results
from ddp_course.tools.scaling import (
    StepTimeModel,
    comm_can_overlap,
    compute_slowdown,
    efficiency_table,
    fit_amdahl,
    fit_gustafson,
)
from ddp_course.tools.trace import load_trace, overlap_report, slim_trace
from ddp_course.tools.zero_counts import storage_bytes
from ddp_course.training import sgd_step_fn

MODES = ["collectives", "scaling", "knobs", "model", "trace"]
TINY = {"min_bytes": 4096, "max_bytes": 65536, "repeats": 2, "warmup": 1, "hidden": 64,
        "layers": 2, "batch_size": 8, "caps": [0.01, 1.0], "steps": 2}


def parse_args():
    meaning = {
        "hidden": "LayerStack width (the model)",
        "batch_size": "samples per rank (strong: global)",
        "steps": "profiled steps per setting (trace)",
        "results": "write the rows here as JSON, and as CSV beside it",
    }
    p = script_parser(
        __doc__, hidden=1024, batch_size=32, steps=3, no_progress=False, results=None, help=meaning
    )
    p.add_argument("modes", nargs="+", choices=[*MODES, "all"], help="what to measure")
    p.add_argument("--min-bytes", type=int, default=4096, help="smallest message (collectives)")
    p.add_argument("--max-bytes", type=int, default=64 * 2**20, help="largest message")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per setting")
    p.add_argument("--repeats", type=int, default=10, help="timed iterations per setting")
    p.add_argument("--layers", type=int, default=6, help="LayerStack hidden layers")
    p.add_argument("--caps", type=float, nargs="+", default=[0.5, 1, 2, 5, 10, 25, 50],
                   help="bucket_cap_mb values (knobs, model)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step (no_sync)")
    p.add_argument("--chrome-trace", help="keep rank 0's trace of torch's DDP here (trace)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and repeats: seconds")
    args = p.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    if "all" in args.modes:
        args.modes = list(MODES)
    if args.repeats < 1 or args.warmup < 0:
        p.error("need --repeats >= 1 and --warmup >= 0")
    return args


def slowest(ctx, seconds: float) -> float:
    """The slowest rank's time of this iteration (every rank calls it)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    if ctx.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def sync(ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def stats(times):
    t = summarize(times)
    return {"median_s": t.median, "iqr_s": t.iqr, "repeats": t.repeats}


def make_model(args, device):
    torch.manual_seed(0)
    return LayerStack(784, args.hidden, args.layers).to(device)


def batch(n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 784, generator=gen).to(device)
    return x, torch.randint(0, 10, (n,), generator=gen).to(device)


# ---------------------------------------------------------------- collectives


def collective_fn(name, nbytes, ctx):
    """One call of collective ``name`` on S = ``nbytes`` as nccl-tests counts S.

    all_reduce and broadcast: a tensor of S bytes; all_gather: S bytes out,
    S/n in from each rank; reduce_scatter: S bytes in, S/n out; all_to_all:
    S bytes in and out, S/n to each peer.
    """
    n, dev = ctx.world_size, ctx.device
    numel = max(n, nbytes // 4 // n * n)  # float32, divisible by n
    full = torch.ones(numel, device=dev)
    part = torch.ones(numel // n, device=dev)
    out = torch.empty_like(full)
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: all_gather_single(out, part),
        "reduce_scatter": lambda: reduce_scatter_single(part, full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
    }[name], numel * 4


def timed(desc, settings, ctx, args, active=None) -> dict:
    """``time_interleaved`` of ``settings`` (``--warmup``, ``--repeats``) under a progress
    bar named ``desc``; ``active(name)``: whether this rank takes part in that setting."""
    with tqdm(total=len(settings) * args.repeats, desc=desc, disable=args.hide) as bar:
        return time_interleaved(
            settings, ctx, args.warmup, args.repeats, active=active, progress=bar.update
        )


def run_collectives(ctx, args, log):
    sizes = message_sizes(args.min_bytes, args.max_bytes, 4)
    settings, nbytes = {}, {}
    for name in COLLECTIVES:
        for size in sizes:
            settings[(name, size)], nbytes[(name, size)] = collective_fn(name, size, ctx)
    times = timed("collectives", settings, ctx, args)
    rows = []
    for (name, size), ts in times.items():
        s, b = nbytes[(name, size)], stats(ts)
        bus = busbw(s, b["median_s"], name, ctx.world_size)
        rows.append({"mode": "collectives", "collective": name, "world_size": ctx.world_size,
                     "bytes": s, **b, "algbw_GBps": algbw(s, b["median_s"]) / 1e9,
                     "busbw_GBps": bus / 1e9})
    summary = {}
    if ctx.world_size > 1:
        for name, fit in fit_each(rows).items():
            summary[name] = {"alpha_s": fit.alpha, "bandwidth_GBps": fit.bandwidth / 1e9,
                             "busbw_plateau_GBps": busbw_plateau(fit, name, ctx.world_size) / 1e9,
                             "half_bandwidth_bytes": fit.half_bandwidth_bytes}
            # A bandwidth is resolved only where the sweep reached the size that takes half of
            # it (alpha / beta); below that, 1/beta is an extrapolation from latency noise.
            largest = max(r["bytes"] for r in rows if r["collective"] == name)
            resolved = fit.beta > 0 and fit.half_bandwidth_bytes <= largest
            bw = f"{fit.bandwidth / 1e9:.2f} GB/s" if resolved else "bandwidth not resolved"
            log.info(f"{name}: alpha {1e6 * fit.alpha:.0f} us, {bw}")
    return rows, {"fits": summary}


# ---------------------------------------------------------------- scaling


def run_scaling(ctx, args, log):
    world_sizes = [n for n in (1, 2, 4, 8) if n <= ctx.world_size]
    groups = {n: dist.new_group(list(range(n))) for n in world_sizes}
    cpus = os.cpu_count() or 1
    settings, where, per_rank_batch = {}, {}, {}
    for n in world_sizes:
        # Strong: the global batch split over n ranks; weak: the same batch on every rank.
        # One thread per rank (torchrun's OMP_NUM_THREADS=1); weak scaling also with every
        # rank using all cores, which oversubscribes them from 2 ranks on.
        variants = [("strong", 1), ("weak", 1)] + ([("weak", cpus)] if cpus > 1 else [])
        for kind, threads in variants:
            per_rank = max(1, args.batch_size // n) if kind == "strong" else args.batch_size
            name = (kind, n, threads)
            where[name] = n
            x, y = batch(per_rank, ctx.device)
            per_rank_batch[name] = len(x)  # what the step really gets
            if ctx.rank < n:
                model = DDP(make_model(args, ctx.device), process_group=groups[n])
                step = sgd_step_fn(model, x, y)
                settings[name] = with_threads(threads, step)
            else:
                settings[name] = None
    # DDP's own cost at one rank: the same step without the wrapper.
    plain = ("plain", 1, 1)
    where[plain] = 1
    x, y = batch(args.batch_size, ctx.device)
    per_rank_batch[plain] = len(x)
    step = sgd_step_fn(make_model(args, ctx.device), x, y)
    settings[plain] = with_threads(1, step)
    times = timed("scaling", settings, ctx, args, active=lambda k: ctx.rank < where[k])
    rows = []
    for (kind, n, threads), ts in times.items():
        b = per_rank_batch[(kind, n, threads)]
        rows.append({"mode": "scaling", "kind": kind, "world_size": n,
                     "threads_per_rank": threads, "oversubscribed": n * threads > cpus,
                     "per_rank_batch": b, "global_batch": b * n, **stats(ts)})
    summary = {"cpus": cpus}
    fair = [r for r in rows if r["threads_per_rank"] == 1]
    for kind in ("strong", "weak"):
        mine = sorted((r for r in fair if r["kind"] == kind), key=lambda r: r["world_size"])
        table = efficiency_table([r["world_size"] for r in mine],
                                 [r["median_s"] for r in mine], kind, args.batch_size)
        summary[kind] = table
        ns, sp = [r["world_size"] for r in table], [r["speedup"] for r in table]
        if len(ns) > 1:
            fit = fit_amdahl if kind == "strong" else fit_gustafson
            summary[f"{kind}_serial_fraction"] = fit(ns, sp)
        for r in table:
            log.info(f"{kind} N={r['world_size']}: efficiency {r['efficiency']:.2f}")
    one = {r["kind"]: r["median_s"] for r in fair if r["world_size"] == 1}
    summary["ddp_over_plain_at_one_rank"] = one["weak"] / one["plain"]
    return rows, summary


def with_threads(threads, fn):
    def run():
        torch.set_num_threads(threads)
        fn()

    return run


# ---------------------------------------------------------------- knobs


def run_knobs(ctx, args, log):
    dev = ctx.device
    x, y = batch(args.batch_size, dev, seed=ctx.rank)
    settings = {}
    for cap in args.caps:
        settings[f"torch DDP cap={cap:g}"] = sgd_step_fn(DDP(make_model(args, dev),
                                                            bucket_cap_mb=cap), x, y)
    settings["BucketedDDP cap=25"] = sgd_step_fn(BucketedDDP(make_model(args, dev)), x, y)
    settings["torch DDP cap=25"] = sgd_step_fn(DDP(make_model(args, dev)), x, y)
    for name, hook in (("fp16", default_hooks.fp16_compress_hook),
                       ("bf16", default_hooks.bf16_compress_hook)):
        model = DDP(make_model(args, dev))
        model.register_comm_hook(None, hook)
        settings[f"{name} hook cap=25"] = sgd_step_fn(model, x, y)
    xs, ys = x[: max(1, args.batch_size // args.accum)], y[: max(1, args.batch_size // args.accum)]
    settings["sync every micro-batch"] = sgd_step_fn(DDP(make_model(args, dev)), xs, ys,
                                                    accum=args.accum)
    settings["no_sync"] = sgd_step_fn(DDP(make_model(args, dev)), xs, ys, accum=args.accum,
                                     no_sync=True)
    times = timed("knobs", settings, ctx, args)
    rows = [{"mode": "knobs", "setting": name, "world_size": ctx.world_size, **stats(ts)}
            for name, ts in times.items()]
    med = {r["setting"]: r["median_s"] for r in rows}
    ratios = {
        "BucketedDDP / torch DDP": med["BucketedDDP cap=25"] / med["torch DDP cap=25"],
        "fp16 hook / no hook": med["fp16 hook cap=25"] / med["torch DDP cap=25"],
        "bf16 hook / no hook": med["bf16 hook cap=25"] / med["torch DDP cap=25"],
        "sync every micro-batch / no_sync": med["sync every micro-batch"] / med["no_sync"],
    }
    for k, v in ratios.items():
        log.info(f"{k}: {v:.2f}")
    return rows, {"ratios": ratios}


# ---------------------------------------------------------------- model


def phased_step(model, x, y, ctx, phases):
    """train_step's SGD step, timing its forward, backward and optimizer into ``phases``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        sync(ctx)
        t1 = time.perf_counter()
        loss.backward()
        sync(ctx)
        t2 = time.perf_counter()
        opt.step()
        sync(ctx)
        for name, seconds in (("forward", t1 - t0), ("backward", t2 - t1),
                              ("optimizer", time.perf_counter() - t2)):
            phases.setdefault(name, []).append(seconds)

    return step


PHASES = ("forward", "backward", "optimizer")


def phase_medians(ctx, phases, warmup):
    """Per phase: the slowest rank of each timed repeat, then the median (seconds)."""
    return {k: summarize([slowest(ctx, t) for t in phases[k][warmup:]]).median for k in PHASES}


def rank0_medians(ctx, phases, warmup):
    """Per phase: the median of rank 0's own timed repeats, sent to every rank (seconds).

    ``phases`` is rank 0's timings; the other ranks, which timed nothing, pass None.
    """
    t = torch.zeros(len(PHASES), dtype=torch.float64, device=ctx.device)
    if ctx.rank == 0:
        t[:] = torch.tensor([summarize(phases[k][warmup:]).median for k in PHASES])
    if ctx.is_distributed:
        dist.broadcast(t, src=0)
    return dict(zip(PHASES, t.tolist(), strict=True))


def run_model(ctx, args, log):
    dev, n = ctx.device, ctx.world_size
    x, y = batch(args.batch_size, dev, seed=ctx.rank)
    # NEW: a prediction of N ranks from one rank. Rank 0 alone times forward, backward and
    # optimizer through the same wrapper in a group of one rank (its hooks and copies, all but
    # the communication) while the other ranks wait: what a one-rank job measures, interleaved
    # with the N-rank steps so that the machine's load falls on both alike. The communication
    # comes from an all-reduce sweep at N ranks. The same compute with every rank at once is
    # timed too, only to show afterwards what the ranks' sharing of the machine costs.
    solo = [dist.new_group([r]) for r in range(n)][ctx.rank]
    phases, settings = {}, {}

    def compute(key, model):
        phases[key] = {}
        return phased_step(model, x, y, ctx, phases[key])

    def solo_ddp(cap):
        return BucketedDDP(make_model(args, dev), bucket_cap_mb=cap, process_group=solo)

    first = ctx.rank == 0  # the other ranks build nothing for rank 0's runs alone
    settings[("alone", "plain")] = (
        compute(("alone", "plain"), make_model(args, dev)) if first else None
    )
    for cap in args.caps:
        settings[("alone", cap)] = compute(("alone", cap), solo_ddp(cap)) if first else None
    for cap in args.caps:
        settings[("together", cap)] = compute(("together", cap), solo_ddp(cap))
    grad_bytes = storage_bytes(make_model(args, dev).parameters())
    sizes = message_sizes(16384, max(2 * grad_bytes, 32768), 4)
    for size in sizes:
        settings[("all_reduce", size)] = collective_fn("all_reduce", size, ctx)[0]
    wrapped = {}
    for cap in args.caps:
        wrapped[cap] = BucketedDDP(make_model(args, dev), bucket_cap_mb=cap)
        settings[("BucketedDDP", cap)] = sgd_step_fn(wrapped[cap], x, y)
    # Does overlap buy anything here? The smallest cap of 1 MB or more with overlap off.
    probe = min((c for c in args.caps if c >= 1), default=max(args.caps))
    if n > 1:
        late = BucketedDDP(make_model(args, dev), bucket_cap_mb=probe, overlap=False)
        settings[("no overlap", probe)] = sgd_step_fn(late, x, y)
    times = timed("model", settings, ctx, args, active=lambda k: k[0] != "alone" or first)
    alone = {
        k: rank0_medians(ctx, phases.get(("alone", k)), args.warmup) for k in ["plain", *args.caps]
    }
    together = {c: phase_medians(ctx, phases[("together", c)], args.warmup) for c in args.caps}
    plain_s = sum(alone["plain"].values())
    ar_rows = [{"collective": "all_reduce", "bytes": s, **stats(times[("all_reduce", s)])}
               for s in sizes]
    rows = [{"mode": "model", "setting": "all_reduce", "bytes": r["bytes"], "world_size": n,
             "median_s": r["median_s"], "iqr_s": r["iqr_s"]} for r in ar_rows]
    # One rank communicates nothing: the model is its compute alone.
    fit = fit_each(ar_rows)["all_reduce"] if n > 1 else AlphaBeta(0.0, 0.0)
    threads, cpus = torch.get_num_threads(), os.cpu_count() or 1
    overlap = comm_can_overlap(dev.type, n, threads, cpus)
    slowdown = compute_slowdown(dev.type, n, threads, cpus)
    for cap in args.caps:
        buckets = wrapped[cap].bucket_bytes()
        measured = stats(times[("BucketedDDP", cap)])
        c, t = alone[cap], together[cap]
        one_rank = StepTimeModel(*(c[k] for k in PHASES), overlap=overlap)
        model = one_rank.slowed(slowdown)
        predicted = model.predict(buckets, fit, n)
        wrapper_s = sum(c.values()) - plain_s  # at one rank, before the slow-down
        # Both assumptions about overlap, whichever the model takes here.
        hidden = dataclasses.replace(model, overlap=True).predict(buckets, fit, n)
        serial = dataclasses.replace(model, overlap=False).predict(buckets, fit, n)
        # The terms measured again at N ranks: not a prediction, where the error comes from.
        remeasured = StepTimeModel(*(t[k] for k in PHASES), overlap=overlap).predict(
            buckets, fit, n
        )
        rows.append({"mode": "model", "setting": "BucketedDDP", "bucket_cap_mb": cap,
                     "buckets": len(buckets), "bytes": sum(buckets), "world_size": n,
                     **measured, "forward_s": c["forward"], "backward_s": c["backward"],
                     "optimizer_s": c["optimizer"], "wrapper_s": wrapper_s,
                     "compute_slowdown": slowdown, "compute_together_s": sum(t.values()),
                     "overlap": overlap, "exposed_comm_s": model.exposed(buckets, fit, n),
                     "predicted_s": predicted, "overlapped_s": hidden, "no_overlap_s": serial,
                     "without_wrapper_s": predicted - slowdown * wrapper_s,
                     "remeasured_s": remeasured,
                     "predicted_over_measured": predicted / measured["median_s"],
                     "overlapped_over_measured": hidden / measured["median_s"],
                     "no_overlap_over_measured": serial / measured["median_s"]})
        log.info(f"cap {cap:g} MB: predicted from one rank {1e3 * predicted:.1f} ms, "
                 f"measured {1e3 * measured['median_s']:.1f} ms")
    buckets = {f"{c:g}": w.bucket_bytes() for c, w in wrapped.items()}
    summary = {"compute_s": alone["plain"], "gradient_bytes": grad_bytes, "overlap": overlap,
               "compute_slowdown": slowdown, "threads_per_rank": threads, "cpus": cpus,
               "bucket_bytes": buckets}
    if n > 1:
        summary["all_reduce_fit"] = {"alpha_s": fit.alpha, "bandwidth_GBps": fit.bandwidth / 1e9}
        on, off = stats(times[("BucketedDDP", probe)]), stats(times[("no overlap", probe)])
        summary["overlap_probe"] = {"bucket_cap_mb": probe, "overlap": on, "no_overlap": off,
                                    "ratio": off["median_s"] / on["median_s"]}
    return rows, summary


# ---------------------------------------------------------------- trace


def run_trace(ctx, args, log):
    from torch.profiler import ProfilerActivity, profile, record_function

    dev = ctx.device
    x, y = batch(args.batch_size, dev, seed=ctx.rank)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    wrappers = {
        "torch DDP cap=1": lambda: DDP(make_model(args, dev), bucket_cap_mb=1),
        "BucketedDDP cap=1": lambda: BucketedDDP(make_model(args, dev), bucket_cap_mb=1),
        "BucketedDDP cap=1 no overlap": lambda: BucketedDDP(make_model(args, dev),
                                                            bucket_cap_mb=1, overlap=False),
    }
    rows, kept = [], None
    bar = tqdm(total=len(wrappers), desc="trace", disable=args.hide)
    for name, build in wrappers.items():
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(max(1, args.warmup)):
            F.cross_entropy(model(x), y).backward()
        barrier(ctx)
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                with record_function("forward"):
                    loss = F.cross_entropy(model(x), y)
                with record_function("backward"):
                    loss.backward()
                with record_function("optimizer"):
                    opt.step()
                    opt.zero_grad()
                sync(ctx)
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp, "trace.json")
            prof.export_chrome_trace(str(path))
            events = load_trace(path)
        report = overlap_report(events) if ctx.world_size > 1 else None
        if name == "torch DDP cap=1":
            kept = slim_trace(events)
        # Every rank's overlap; the table shows rank 0's and the least of all.
        frac = report["overlap_fraction"] if report else 0.0
        least = -slowest(ctx, -frac)
        rows.append({"mode": "trace", "setting": name, "world_size": ctx.world_size,
                     "steps": args.steps,
                     **({k: v for k, v in report.items()} if report else {}),
                     "least_overlap_fraction_over_ranks": least})
        bar.update()
        barrier(ctx)
    bar.close()
    for r in rows:
        if "overlap_fraction" in r:
            log.info(f"{r['setting']}: {100 * r['overlap_fraction']:.0f}% of all-reduce time "
                     "overlaps backward (rank 0)")
    if args.chrome_trace and ctx.is_main:
        out = pathlib.Path(args.chrome_trace)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(kept) + "\n")
    return rows, {}


RUN = {"collectives": run_collectives, "scaling": run_scaling, "knobs": run_knobs,
       "model": run_model, "trace": run_trace}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        args.hide = args.no_progress or not ctx.is_main
        log = get_logger(ctx)
        rows, summary = [], {}
        for mode in args.modes:
            mode_rows, summary[mode] = RUN[mode](ctx, args, log)
            rows += mode_rows
        shown = {k: v for k, v in vars(args).items() if k != "hide"}
        path = write_results(ctx, args.results, {"summary": summary}, rows=rows, args=shown)
        if path is not None:
            log.info(f"wrote {path.name} and {path.with_suffix('.csv').name}")


if __name__ == "__main__":
    main()
