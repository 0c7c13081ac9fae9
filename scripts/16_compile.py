"""torch.compile with DDP: graphs per bucket, overlap, recompiles across ranks, speed.

Run from the repository root:
    python scripts/16_compile.py
    torchrun --nproc_per_node=2 scripts/16_compile.py
    torchrun --nproc_per_node=2 scripts/16_compile.py --part speed --steps 20

Part "ddp" (float64, backend aot_eager: AOTAutograd's graphs run by eager
kernels, so compiled and eager runs can be compared to the last bit): each
rank trains the same MLP for --steps SGD steps on its own batches, wrapped in
DDP with --bucket-cap-mb, once per variant: eager DDP; DDP around a compiled
module, with the DDP optimizer (torch._dynamo.config.optimize_ddp=True: one
graph per bucket), without it (one graph), and with compiled autograd
(optimize_ddp="python_reducer"); compile around DDP (the other order);
find_unused_parameters=True and no_sync, eager and compiled; and, without DDP,
each gradient all-reduced in its own hook under compiled autograd, with and
without an .item() in the hook (a graph break per hook). For each it
counts the graphs Dynamo hands the backend and the parameter bytes each reads
(ddp_course.tools.graph_count), logs every collective of the last step
(ddp_course.tools.collective_log), records the order in which the bucket
all-reduces start and the input's gradient is computed (a comm hook and a
tensor hook: an all-reduce that starts before the input's gradient overlaps
the rest of backward), and compares the parameters with eager DDP's.

Part "recompile": the last rank's batch is shorter at one step (an uneven
last batch) or a Python float the model reads differs on it; that rank alone
recompiles and the others wait for it at the next all-reduce. Each rank
reports its graphs, the recompile log's reasons and its step times; then the
same with the fix (torch._dynamo.mark_dynamic on the batch dimension; the
value passed as a tensor).

Part "speed" (float32, backend inductor): TinyGPT's training step, eager
against compiled, timed interleaved (median and interquartile range of the
slowest rank), with DDP on several ranks; the first compiled step (compile
time), a second compile from Inductor's cache, and the cost of a
recompilation (a new sequence length). Inductor keeps its cache where
TORCHINDUCTOR_CACHE_DIR says (by default in the temporary folder).
Rank 0 writes --results.
"""

import contextlib
import logging
import time
from typing import NamedTuple

import torch
import torch._dynamo as dynamo
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.harness.script_args import script_parser
from ddp_course.mesh_runs import gather_lists
from ddp_course.models import MLP, TinyGPT, lm_loss
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.bench.timing import summarize, time_interleaved
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.graph_count import GraphCounter, recompile_reasons
from ddp_course.tools.records import write_results

PARTS = ("ddp", "recompile", "speed")


def parse_args():
    meaning = {
        "hidden": "width of the MLP of parts ddp and recompile",
        "batch_size": "samples (part speed: sequences) per rank per step",
        "steps": "SGD steps per variant (part speed: timed steps)",
    }
    p = script_parser(__doc__, hidden=256, batch_size=8, steps=3, lr=1e-2, seed=0,
                      d_model=64, n_heads=4, n_layers=2, seq_len=64, results=None,
                      help=meaning)
    p.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS), help="what to run")
    p.add_argument("--depth", type=int, default=5, help="hidden layers of the MLP")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0,
                   help="DDP's bucket cap (the DDP optimizer refuses one below 1 MiB)")
    p.add_argument("--variants", nargs="*", default=None, help="part ddp: only these")
    return p.parse_args()


def wait_for(device):
    """Let a GPU finish its queued kernels, so the clock read next includes them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Part "ddp" -------------------------------------------------------------------------------------

class Variant(NamedTuple):
    compile: str | None = None  # None (eager), "inside" DDP, "outside" DDP
    optimize_ddp: bool | str = True  # torch._dynamo.config.optimize_ddp
    ddp_kwargs: dict = {}
    micro: int = 1  # micro-batches per step, all but the last under no_sync
    hooks: str | None = None  # no DDP: "average" gradients in hooks, or "average+item"


VARIANTS = {
    "eager": Variant(),
    "DDP(compile(m))": Variant("inside"),
    "one graph": Variant("inside", optimize_ddp=False),
    "compiled autograd": Variant("inside", optimize_ddp="python_reducer"),
    "compile(DDP(m))": Variant("outside"),
    "eager, find_unused": Variant(ddp_kwargs={"find_unused_parameters": True}),
    "compiled, find_unused": Variant("inside", ddp_kwargs={"find_unused_parameters": True}),
    "eager, no_sync": Variant(micro=2),
    "compiled, no_sync": Variant("inside", micro=2),
    "hooks, compiled autograd": Variant("inside", hooks="average"),
    "hooks with .item(), compiled autograd": Variant("inside", hooks="average+item"),
}


def mlp(args, device):
    torch.manual_seed(args.seed)
    return MLP(args.hidden, args.hidden, args.depth, args.hidden).to(device, torch.float64)


def averaging_hook(events):
    """DDP's own all-reduce of a bucket (sum, then divide), noting when it starts."""

    def hook(group, bucket):
        events.append(f"all-reduce bucket {bucket.index()}")
        world = dist.get_world_size(group)
        work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0].div_(world))

    return hook


def average_in_hooks(model, world, norms=None):
    """Lesson 07's naive data parallelism: each gradient all-reduced as it is accumulated.

    With ``norms`` (a list) each hook also appends its gradient's norm as a Python float,
    the kind of logging that breaks a compiled autograd graph at every hook.
    """

    def hook(p):
        dist.all_reduce(p.grad)
        p.grad.div_(world)
        if norms is not None:
            norms.append(p.grad.norm().item())

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def ddp_variant(name, args, ctx):
    v = VARIANTS[name]
    dynamo.reset()
    dynamo.utils.counters.clear()
    dynamo.config.optimize_ddp = v.optimize_ddp
    counter = GraphCounter("aot_eager")
    model = mlp(args, ctx.device)
    if v.compile == "inside":
        model.compile(backend=counter)  # in place: DDP sees the same parameters
    events = []
    if v.hooks:
        ddp = step_fn = model
        average_in_hooks(model, ctx.world_size, [] if v.hooks == "average+item" else None)
    else:
        ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb, **v.ddp_kwargs)
        step_fn = torch.compile(ddp, backend=counter) if v.compile == "outside" else ddp
        if v.optimize_ddp != "python_reducer":
            ddp.register_comm_hook(None, averaging_hook(events))
    traced_backward = v.optimize_ddp == "python_reducer" or v.hooks
    log = CollectiveLog()

    def backward_context():
        if not traced_backward:
            return contextlib.nullcontext()
        # Compiled autograd traces backward, the gradient hooks included, into graphs.
        return torch._dynamo.compiled_autograd._enable(torch.compile(backend=counter))

    gen = torch.Generator().manual_seed(args.seed + 1000 * ctx.rank)
    for step in range(args.steps):
        with log.recording(f"step {step}"):
            for m in range(v.micro):
                events.clear()  # the events of the step's last backward remain
                x = torch.randn(args.batch_size, args.hidden, dtype=torch.float64, generator=gen)
                x = x.to(ctx.device).requires_grad_()
                x.register_hook(lambda g: events.append("input gradient"))
                sync = m == v.micro - 1
                with (contextlib.nullcontext() if sync else ddp.no_sync()), backward_context():
                    step_fn(x).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= args.lr * p.grad
                p.grad = None
    last = f"step {args.steps - 1}"
    # A traced backward runs no comm hook: its all-reduces are in the backward graph.
    before = None if traced_backward else events.index("input gradient")
    return {
        "graphs": len(counter.graphs),
        "graph_parameter_bytes": counter.parameter_bytes(),
        "graph_collectives": counter.collectives(),
        "graph_breaks": sum(dynamo.utils.counters["graph_break"].values()),
        "collectives": log.summary(last),
        "collective_paths": sorted({c["path"] for c in log.calls if c["phase"] == last}),
        "first_step_collectives": log.summary("step 0"),
        "second_step_collectives": log.summary("step 1"),
        "events": list(events),
        "all_reduces_before_input_gradient": None if before is None else sum(
            e.startswith("all-reduce") for e in events[:before]),
        "params": [p.detach().cpu() for p in model.parameters()],
    }


def part_ddp(args, ctx, log):
    names = args.variants or list(VARIANTS)
    runs = {name: ddp_variant(name, args, ctx) for name in names}
    out = {}
    for name, run in runs.items():
        reference = runs.get("eager, no_sync" if "no_sync" in name else "eager")
        gap = None if reference is None else max(
            (a - b).abs().max().item() for a, b in zip(run["params"], reference["params"]))
        out[name] = {k: v for k, v in run.items() if k != "params"}
        out[name]["max_param_diff_vs_eager"] = gap  # None: eager was not run
        log.info("%-22s graphs %d, all-reduces before the input's gradient %s, diff %s",
                 name, run["graphs"], run["all_reduces_before_input_gradient"], gap)
    return out


# Part "recompile" -------------------------------------------------------------------------------

class Scaled(nn.Module):
    """An MLP whose output is multiplied by a Python float given at each call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, scale):
        return self.inner(x) * scale


def recompile_run(args, ctx, what, fixed, odd_step):
    dynamo.reset()
    counter = GraphCounter("aot_eager")
    model = Scaled(mlp(args, ctx.device)).to(ctx.device)
    model.compile(backend=counter)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    last = ctx.rank == ctx.world_size - 1
    times = []
    with recompile_reasons() as reasons:
        for step in range(args.steps):
            rows = args.batch_size
            scale = 1.0
            if step == odd_step and last and what == "shape":
                rows -= 2  # this rank's share of the data set ended early
            if step == odd_step and last and what == "python value":
                scale = 0.5
            x = torch.ones(rows, args.hidden, dtype=torch.float64, device=ctx.device)
            if fixed and what == "shape":
                dynamo.mark_dynamic(x, 0)
            if fixed and what == "python value":
                scale = torch.tensor(scale, dtype=torch.float64, device=ctx.device)
            start = time.perf_counter()
            ddp(x, scale).square().mean().backward()
            wait_for(ctx.device)
            times.append(time.perf_counter() - start)
    return {"graphs": len(counter.graphs), "recompiles": list(reasons), "step_s": times}


def part_recompile(args, ctx, log):
    odd_step = args.steps - 2
    out = {"odd_step": odd_step, "odd_rank": ctx.world_size - 1}
    for what in ("shape", "python value"):
        for fixed in (False, True):
            every = gather_lists(ctx, recompile_run(args, ctx, what, fixed, odd_step))
            key = f"{what}, {'fixed' if fixed else 'as written'}"
            out[key] = every
            log.info("%-26s graphs per rank %s", key, [r["graphs"] for r in every])
    return out


# Part "speed" -----------------------------------------------------------------------------------

def gpt_step(model, x, y):
    loss = lm_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss


def part_speed(args, ctx, log):
    tokens = shakespeare_bytes()
    gen = torch.Generator().manual_seed(args.seed + ctx.rank)
    x, y = (t.to(ctx.device) for t in lm_batch(tokens, args.batch_size, args.seq_len, gen))

    def build(compiled):
        torch.manual_seed(args.seed)
        model = TinyGPT(d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
                        seq_len=args.seq_len).to(ctx.device)
        if compiled:
            model.compile()
        return DDP(model) if ctx.world_size > 1 else model

    def first_step():
        """The compiled model's first step: seconds, and Inductor's cache hits and misses."""
        dynamo.reset()
        dynamo.utils.counters.clear()
        model = build(True)
        start = time.perf_counter()
        gpt_step(model, x, y)
        wait_for(ctx.device)
        seconds = time.perf_counter() - start
        cache = dynamo.utils.counters["inductor"]
        return model, {"s": seconds, "cache_hits": cache["fxgraph_cache_hit"],
                       "cache_misses": cache["fxgraph_cache_miss"]}

    eager = build(False)
    _, compile_1 = first_step()
    # After a reset Dynamo traces again and Inductor finds the same graphs in its cache.
    compiled, compile_2 = first_step()
    times = time_interleaved({"eager": lambda: gpt_step(eager, x, y),
                              "compiled": lambda: gpt_step(compiled, x, y)},
                             ctx, warmup=2, repeats=args.steps)
    short_x, short_y = x[:, : args.seq_len // 2], y[:, : args.seq_len // 2]
    first = time.perf_counter()
    gpt_step(compiled, short_x, short_y)
    wait_for(ctx.device)
    recompile_s = time.perf_counter() - first
    out = {"first_compile": compile_1, "second_compile": compile_2, "recompile_s": recompile_s,
           "threads": torch.get_num_threads()}
    for name, ts in times.items():
        t = summarize(ts)
        out[name] = {"median_s": t.median, "q1_s": t.q1, "q3_s": t.q3, "times_s": ts}
    out["speedup"] = out["eager"]["median_s"] / out["compiled"]["median_s"]
    log.info("eager %.1f ms, compiled %.1f ms (x%.2f); compile %.1f s, from cache %.1f s, "
             "recompile %.1f s", 1e3 * out["eager"]["median_s"], 1e3 * out["compiled"]["median_s"],
             out["speedup"], compile_1["s"], compile_2["s"], recompile_s)
    return out


def main():
    args = parse_args()
    # Inductor's C++ path looks for CUDA first and warns that there is none: not needed here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # The script counts graph breaks and recompilations itself; Dynamo's own warnings
    # about them would repeat it once per hook, with the paths of this machine.
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        results = {"world_size": ctx.world_size, "device": str(ctx.device)}
        for part in args.part:
            results[part] = {"ddp": part_ddp, "recompile": part_recompile,
                             "speed": part_speed}[part](args, ctx, log)
        write_results(ctx, args.results, results, args=vars(args))


if __name__ == "__main__":
    main()
