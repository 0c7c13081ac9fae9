"""Worker: Megatron-LM tensor parallelism against one process, counted and broken on purpose.

Every rank builds the same two-block MLP (same seed) as the single-process
reference and splits it with ``ParallelFeedForward``. It measures, without asserting
in between (so that every rank always runs the same collectives, even when a
check fails): the output, the input gradient, every gathered weight gradient,
the gathered weights after SGD steps, and every collective, per phase
(``CollectiveLog``, which reads them from the dispatcher). It does this three
times: as written, with f's backward lacking its all-reduce, and with the
row-parallel bias added on every rank before the all-reduce. Then it splits
the same MLP with ``parallelize_module`` (ColwiseParallel, RowwiseParallel)
and compares it with ours, counting both with ``CommDebugMode``.

    torchrun --nproc_per_node=2 tests/workers/tensor_parallel_check.py
"""

import contextlib
import functools

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.functional import mse_loss

from ddp_course import tensor_parallel as tp
from ddp_course.models import FeedForward
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(
    d_model=8,
    hidden=24,  # divisible by 2, 3 and 4
    batch_size=6,
    blocks=2,
    steps=3,
)

RTOL, ATOL = 1e-5, 1e-6


def reference_model():
    torch.manual_seed(0)
    return nn.Sequential(*[FeedForward(args.d_model, args.hidden) for _ in range(args.blocks)])


def parallel_model(ref, ctx):
    return nn.Sequential(*[tp.ParallelFeedForward(b, ctx.rank, ctx.world_size) for b in ref])


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)  # same batch on every rank
    x = torch.randn(args.batch_size, args.d_model, generator=gen)
    return x, torch.randn(args.batch_size, args.d_model, generator=gen)


mismatch = functools.partial(worker_checks.mismatch, rtol=RTOL, atol=ATOL)


# How each parameter of a ParallelFeedForward is split: fc1 by rows, fc2's weight by
# columns; fc2's bias is whole on every rank (None).
SPLIT_DIM = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}


def whole_params(par, grads=True):
    """Whole gradients (or weights) rebuilt from the shards, named like the reference's."""
    out = {}
    for i, block in enumerate(par):
        for name, dim in SPLIT_DIM.items():
            param = block.get_parameter(name)
            shard = param.grad if grads else param.detach()
            out[f"{i}.{name}"] = shard if dim is None else tp.gather_shards(shard, dim)
    return out


@contextlib.contextmanager
def broken(variant):
    """The two mistakes the checks must catch, patched in for the duration."""
    if variant == "f_backward_without_all_reduce":
        original = tp.CopyToParallel.backward
        tp.CopyToParallel.backward = staticmethod(lambda ctx, grad: (grad, None))
        try:
            yield
        finally:
            tp.CopyToParallel.backward = original
    elif variant == "bias_added_on_every_rank":
        original = tp.RowParallelLinear.forward

        def forward(self, x_shard):
            return tp.reduce_from_parallel(nn.functional.linear(x_shard, self.weight, self.bias))

        tp.RowParallelLinear.forward = forward
        try:
            yield
        finally:
            tp.RowParallelLinear.forward = original
    else:
        yield


def check(ctx, variant):
    """Every comparison with one process; a dict of check name -> None or what differed."""
    ref = reference_model()
    par = parallel_model(ref, ctx)
    log = CollectiveLog()
    x, target = batch(0)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    mse_loss(out_ref, target).backward()
    with broken(variant):
        with log.recording("forward"):
            out_par = par(x_par)
        with log.recording("backward"):
            mse_loss(out_par, target).backward()
    ref_grads = {name: q.grad for name, q in ref.named_parameters()}
    got = whole_params(par)
    fails = {"output": mismatch(out_par, out_ref), "input_grad": mismatch(x_par.grad, x_ref.grad)}
    for name, g in ref_grads.items():
        fails[f"grad {name}"] = mismatch(got[name], g)
    # A few SGD steps on fresh batches: the gathered weights follow the reference's.
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_par = torch.optim.SGD(par.parameters(), lr=0.1)
    for step in range(1, args.steps + 1):
        opt_ref.step(), opt_par.step()
        opt_ref.zero_grad(), opt_par.zero_grad()
        x, target = batch(step)
        mse_loss(ref(x), target).backward()
        with broken(variant):
            mse_loss(par(x), target).backward()
    opt_ref.step(), opt_par.step()
    weights = whole_params(par, grads=False)
    for name, q in ref.named_parameters():
        fails[f"after {args.steps + 1} SGD steps {name}"] = mismatch(weights[name], q.detach())
    expected_bytes = args.batch_size * args.d_model * x.element_size()
    counts = {
        phase: sum(c["phase"] == phase and c["op"] == "all_reduce" for c in log.calls)
        for phase in ("forward", "backward")
    }
    fails["one all-reduce per block in forward"] = (
        None if counts["forward"] == args.blocks else f"{counts['forward']} in forward"
    )
    fails["one all-reduce per block in backward"] = (
        None if counts["backward"] == args.blocks else f"{counts['backward']} in backward"
    )
    bad_bytes = [c["bytes"] for c in log.calls if c["bytes"] != expected_bytes]
    fails["bytes = batch x d_model x 4"] = f"{bad_bytes} bytes" if bad_bytes else None
    return {
        "fails": fails,
        "counts": counts,
        "calls": log.calls,
        "expected_bytes": expected_bytes,
        "params_per_rank": sum(q.numel() for q in par.parameters()),
        "params_whole": sum(q.numel() for q in ref.parameters()),
    }


def torch_api(ctx):
    """parallelize_module against ours, both counted with CommDebugMode."""
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    ours, theirs = parallel_model(reference_model(), ctx), reference_model()
    plan = {}
    for i in range(args.blocks):
        plan[f"{i}.fc1"], plan[f"{i}.fc2"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(theirs, mesh, plan)
    x, target = batch(0)
    counts, outs, xs = {}, {}, {}
    for name, model in (("ours", ours), ("torch", theirs)):
        xs[name] = x.clone().requires_grad_()
        fwd, bwd = CommDebugMode(), CommDebugMode()
        with fwd:
            outs[name] = model(xs[name])
        with bwd:
            mse_loss(outs[name], target).backward()
        counts[name] = {
            "forward": {str(k): v for k, v in fwd.get_comm_counts().items()},
            "backward": {str(k): v for k, v in bwd.get_comm_counts().items()},
            "forward_total": fwd.get_total_counts(),
            "backward_total": bwd.get_total_counts(),
        }
    fails = {
        "output": mismatch(outs["torch"], outs["ours"]),
        "input_grad": mismatch(xs["torch"].grad, xs["ours"].grad),
    }
    mine = whole_params(ours)
    for name, q in theirs.named_parameters():
        kinds = {type(p).__name__ for p in q.grad.placements}
        fails[f"grad {name} ({'/'.join(sorted(kinds))})"] = mismatch(
            q.grad.full_tensor(), mine[name]
        )
    return {"fails": fails, "counts": counts}


with distributed(device="cpu") as ctx:
    out = {"world_size": ctx.world_size, "variants": {}}
    for variant in ("as_written", "f_backward_without_all_reduce", "bias_added_on_every_rank"):
        mine = check(ctx, variant)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        out["variants"][variant] = gathered
    mine = torch_api(ctx)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    out["torch"] = gathered
    write_results(ctx, args.results, out)
