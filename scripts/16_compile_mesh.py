"""torch.compile meets distributed training: FSDP2 and tensor parallelism on a device mesh.

Run from the repository root:
    python scripts/16_compile_mesh.py
    torchrun --nproc_per_node=2 scripts/16_compile_mesh.py
    torchrun --nproc_per_node=4 scripts/16_compile_mesh.py --n-heads 4
    torchrun --nproc_per_node=2 scripts/16_compile_mesh.py --backend inductor

Everything runs in float64, so a compiled run and an eager one can be compared to
about 1e-12. The backend is aot_eager by default: Dynamo's graph goes through AOT
autograd (forward and backward graphs) and runs unfused, which is what this lesson
looks at; --backend inductor compiles kernels too (a cold compile takes seconds per
graph on a CPU). A counting backend (ddp_course.tools.graph_count) keeps every graph
Dynamo hands the backend and, under aot_eager, the forward and backward graphs AOT
autograd makes of it.

FSDP2 (part 1): TinyGPT's blocks compiled one by one, then sharded (torchtitan's
order: tensor parallel, activation checkpointing, compile, FSDP), then the root
sharded, over a 1-D mesh of every rank; --steps SGD steps on the same global batches
as eager FSDP2 built the same way and as one process on the whole batch. Then the
same with each block in lesson 14's checkpoint wrapper before it is compiled; then
the whole sharded model compiled at once, with and without fullgraph=True. For each:
the parameters' gap to eager FSDP2 and to one process, the graphs compiled, the
graph breaks, and every step's collectives (the course's CollectiveLog: op, calls,
bytes) against eager FSDP2's.

Tensor parallelism (part 2): one TinyGPT block's attention and MLP split with
parallelize_module over a 1-D "tp" mesh of every rank (--n-heads must be a
multiple of the world size), compiled, one forward and backward against the eager
split block and one process: output and gradients, the collectives logged in
forward and backward, and the collectives that are nodes of the compiled graphs.

The script reports; the checks live in tests/scripts/test_lesson16_mesh.py. What
goes wrong when compiling the whole model is reported as its error's first line.
Results go to --results (rank 0).
"""

import copy
import os
import re
import warnings
from collections import Counter

import torch
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ddp_course import mesh_runs as runs
from ddp_course.harness.script_args import script_parser
from ddp_course.models import Block, lm_loss
from ddp_course.recompute_policies import CheckpointWrapper
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.graph_count import GraphCounter
from ddp_course.tools.records import write_results

# FSDP2 warns that the root returns a view (we never change the logits in place).
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

DTENSOR_CALLS = ("from_local", "redistribute", "to_local", "full_tensor")
# Where a graph break sends Dynamo when it gives up on a frame, as its message says.
SKIPPED = re.compile(r"frame skipped: (\w+) \((.*) line (\d+)\)")


def parse_args():
    meaning = {
        "batch_size": "sequences per rank per step (one process: the whole global batch)",
        "steps": "SGD steps of each FSDP2 run",
        "n_heads": "attention heads (a multiple of the world size: tensor parallelism)",
    }
    p = script_parser(__doc__, d_model=16, n_heads=2, n_layers=2, seq_len=16, batch_size=4,
                      steps=3, lr=0.1, seed=0, results=None, help=meaning)
    p.add_argument("--backend", choices=("aot_eager", "inductor", "eager"), default="aot_eager",
                   help="torch.compile's backend (aot_eager: AOT autograd's graphs, no kernels)")
    return p.parse_args()


def calls(gm):
    """What a graph calls, in order, by name: ``linear``, ``_c10d_functional.all_reduce.default``
    (an operator of AOT autograd's graphs), ``from_local`` (a DTensor method of Dynamo's)."""
    names = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            t = node.target
            names.append(str(t) if isinstance(t, torch._ops.OpOverload) else getattr(
                t, "__name__", str(t)))
    return names


def graph_report(graphs):
    """What a GraphCounter saw: Dynamo's graphs, their runs, and the collectives in each kind."""
    aot = None
    if graphs.inner == "aot_eager":  # Inductor keeps its forward and backward graphs inside
        aot = graphs.aot_collectives()
    dtensor = Counter(name for gm in graphs.graphs for name in calls(gm) if name in DTENSOR_CALLS)
    return {
        "count": len(graphs.graphs),
        "runs": graphs.runs,  # forward calls of each graph
        # What each graph computes: an FSDP2 block's has no all-gather in it.
        "ops": [calls(gm) for gm in graphs.graphs],
        "collective_nodes_dynamo": dict(Counter(sum(graphs.collectives(), []))),
        # DTensor's own calls: where AOT autograd puts the collectives.
        "dtensor_nodes_dynamo": dict(sorted(dtensor.items())),
        "collective_nodes_aot": aot,  # None: the backend keeps them to itself
        # Operations of AOT autograd's graphs: a checkpointed block's backward graph
        # recomputes its forward, so it holds more.
        "aot_ops": None if aot is None else {
            kind: sum(len(calls(gm)) for k, gm in graphs.aot if k == kind)
            for kind in ("forward", "backward")},
    }


def dynamo_report():
    """Dynamo's counters since the last clear: frames, graph breaks and why, frames skipped."""
    reasons, skipped = {}, []
    for key in counters["unimplemented"]:
        # A break met while handling another is written after the first, in one key.
        for part in key.split("*** While handling this graph break, another graph break"):
            lines = [line.strip() for line in part.splitlines()]
            lines = [line for line in lines if line and not line.startswith("occurred")]
            reasons[lines[0].strip("* ") if lines else ""] = None
        for fn, path, line in SKIPPED.findall(key):
            skipped.append(f"{fn} ({os.path.basename(path)} line {line})")
    # A frame Dynamo gives up on counts as "unimplemented", not as a "graph_break".
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unimplemented": sum(counters["unimplemented"].values()),
            "break_reasons": list(reasons), "frames_skipped": skipped,
            "frames": dict(counters["frames"])}


def fresh_compiler():
    """Forget every compiled graph and count from zero (one variant's graphs only)."""
    torch._dynamo.reset()
    counters.clear()


def my_slice(ctx, batch):
    per = batch[0].shape[0] // ctx.world_size
    return [t[ctx.rank * per:(ctx.rank + 1) * per] for t in batch]


def model_config(args):
    return dict(d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
                seq_len=args.seq_len)


def sharded_model(args, ctx, mesh, compile_block=None, checkpoint=False):
    """TinyGPT, each block checkpointed and compiled (if asked), then sharded, then the root
    sharded: torchtitan's order (activation checkpointing, compile, FSDP) on every block."""
    model = runs.new_model(model_config(args), torch.float64, ctx.device, args.seed)
    for i, block in enumerate(model.blocks):
        if checkpoint:
            # Lesson 14's wrapper around torch.utils.checkpoint (non-reentrant).
            block = model.blocks[i] = CheckpointWrapper(block, impl="torch")
        if compile_block is not None:
            # In place: the block keeps its name, FSDP2's hooks go on the block itself.
            block.compile(backend=compile_block)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def plain_name(name):
    """A parameter's name in TinyGPT, without what compile or a checkpoint wrapper added."""
    return re.sub(r"^(blocks\.\d+)\.module\.", r"\1.", name.replace("_orig_mod.", ""))


def train_fsdp(args, ctx, model, batches):
    """--steps SGD steps; whole parameters by name and each step's collectives."""
    log = CollectiveLog(next(model.parameters()).device_mesh)
    opt = runs.sgd(model.parameters(), args.lr)
    for step, batch in enumerate(batches):
        x, y = my_slice(ctx, batch)
        with log.recording(f"step {step}"):
            lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    params = {plain_name(n): p.full_tensor().detach()
              for n, p in model.named_parameters()}
    steps = [{"counts": log.counts(f"step {s}"), "bytes": log.summary(f"step {s}")}
             for s in range(len(batches))]
    return params, steps


def fsdp_variant(args, ctx, batches, build, eager, alone):
    """One compiled FSDP2 variant against eager FSDP2 (``eager``) and one process."""
    fresh_compiler()
    graphs = GraphCounter(args.backend)
    report = {"error": None}
    try:
        params, steps = train_fsdp(args, ctx, build(graphs), batches)
    except Exception as e:  # the error is the result: report it and go on
        lines = str(e).strip().splitlines()
        report["error"] = f"{type(e).__name__}: {lines[0] if lines else ''}"
    else:
        report |= {"gap_vs_eager": runs.max_gap(params, eager["params"]),
                   "gap_vs_one_process": runs.max_gap(params, alone),
                   "collectives": steps,
                   "collectives_equal_eager": steps == eager["collectives"]}
    report["graphs"] = graph_report(graphs)
    report |= dynamo_report()
    return report


def fsdp_part(args, ctx, log):
    n = ctx.world_size
    mesh = init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("shard",))
    batches = runs.global_batches(args.steps, args.batch_size * n, args.seq_len, args.seed,
                                  ctx.device)
    start = runs.new_model(model_config(args), torch.float64, ctx.device, args.seed)
    initial = {name: p.detach().clone() for name, p in start.named_parameters()}
    alone, _ = runs.one_process(start, batches, args.lr)
    params, steps = train_fsdp(args, ctx, sharded_model(args, ctx, mesh), batches)
    eager = {"params": params, "collectives": steps}
    # How far training moved the weights: equality after it means something.
    out = {"mesh": {"shard": n}, "steps": args.steps, "moved": runs.max_gap(alone, initial),
           "eager": {"gap_vs_one_process": runs.max_gap(params, alone), "collectives": steps}}

    def per_block(backend):
        return sharded_model(args, ctx, mesh, compile_block=backend)

    def per_block_checkpointed(backend):
        return sharded_model(args, ctx, mesh, compile_block=backend, checkpoint=True)

    def whole_model(backend, fullgraph=False):
        return torch.compile(sharded_model(args, ctx, mesh), backend=backend, fullgraph=fullgraph)

    variants = {
        "per_block": per_block,
        "per_block_checkpointed": per_block_checkpointed,
        "whole_model": whole_model,
        "whole_model_fullgraph": lambda backend: whole_model(backend, fullgraph=True),
    }
    for name, build in variants.items():
        out[name] = r = fsdp_variant(args, ctx, batches, build, eager, alone)
        if r["error"]:
            log.info(f"FSDP2, {name}: {r['error']}")
        else:
            log.info(f"FSDP2, {name}: {r['graphs']['count']} graph(s) run "
                     f"{r['graphs']['runs']} times, frames left eager "
                     f"{r['frames_skipped'] or 'none'} {r['break_reasons']}; |compiled - eager| "
                     f"{r['gap_vs_eager']:.1e}, |compiled - one process| "
                     f"{r['gap_vs_one_process']:.1e}, collectives as eager: "
                     f"{r['collectives_equal_eager']}")
    return out


def tp_plan():
    """Megatron's split of a block: q, k, v and fc1 by columns, proj and fc2 by rows."""
    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}


def tp_run(block, x, w, mesh):
    """Output, input gradient, whole parameter gradients; collectives of each phase."""
    log = CollectiveLog(mesh)
    x = x.clone().requires_grad_()
    with log.recording("forward"):
        y = block(x)
    with log.recording("backward"):
        (y * w).sum().backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             for n, p in block.named_parameters()}
    phases = ("forward", "backward")
    return {"output": y.detach(), "input gradient": x.grad, "grads": grads,
            "collectives": {ph: {"counts": log.counts(ph), "bytes": log.summary(ph)}
                            for ph in phases}}


def tp_gaps(a, b):
    return {"output": (a["output"] - b["output"]).abs().max().item(),
            "input gradient": (a["input gradient"] - b["input gradient"]).abs().max().item(),
            "parameter gradients": runs.max_gap(a["grads"], b["grads"])}


def tp_part(args, ctx, log):
    n, dev = ctx.world_size, ctx.device
    mesh = init_device_mesh(dev.type, (n,), mesh_dim_names=("tp",))
    torch.manual_seed(args.seed)  # the same block on every rank
    whole = Block(args.d_model, args.n_heads).to(device=dev, dtype=torch.float64)
    gen = torch.Generator().manual_seed(args.seed + 1)  # every rank the whole batch
    x, w = (torch.randn(args.batch_size, args.seq_len, args.d_model, generator=gen,
                        dtype=torch.float64).to(dev) for _ in range(2))
    alone = tp_run(copy.deepcopy(whole), x, w, mesh)

    def split():
        return parallelize_module(copy.deepcopy(whole), mesh, tp_plan())

    eager = tp_run(split(), x, w, mesh)
    fresh_compiler()
    graphs = GraphCounter(args.backend)
    block = split()
    block.compile(backend=graphs)
    compiled = tp_run(block, x, w, mesh)
    out = {"mesh": {"tp": n}, "gaps": {"eager vs one process": tp_gaps(eager, alone),
                                       "compiled vs eager": tp_gaps(compiled, eager),
                                       "compiled vs one process": tp_gaps(compiled, alone)},
           "eager": {"collectives": eager["collectives"]},
           "compiled": {"collectives": compiled["collectives"], "graphs": graph_report(graphs),
                        **dynamo_report()},
           "collectives_equal_eager": compiled["collectives"] == eager["collectives"]}
    gap = max(out["gaps"]["compiled vs one process"].values())
    aot = out["compiled"]["graphs"]["collective_nodes_aot"]
    log.info(f"tensor parallel block on {n} rank(s): {graph_report(graphs)['count']} graph(s), "
             f"|compiled - one process| {gap:.1e}, collectives as eager: "
             f"{out['collectives_equal_eager']}, collective nodes of AOT's graphs: {aot}")
    return out


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        if args.n_heads % ctx.world_size:
            raise ValueError(f"{ctx.world_size} ranks do not divide --n-heads {args.n_heads}: "
                             "tensor parallelism splits whole heads")
        result = {"world_size": ctx.world_size, "device": str(ctx.device),
                  "backend": args.backend,
                  "config": {**model_config(args), "batch_size": args.batch_size,
                             "dtype": "float64"},
                  "fsdp": fsdp_part(args, ctx, log), "tp": tp_part(args, ctx, log)}
        write_results(ctx, args.results, result, args=vars(args))


if __name__ == "__main__":
    main()
