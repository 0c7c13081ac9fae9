"""Worker: expert-parallel MoE against one process, counted, and broken on purpose.

Every rank builds the same MoE (same seed) in float64 and its own slice of
one global batch. The one-process reference runs the whole batch with
``groups=world_size`` (capacity per rank's tokens). Each variant measures,
without asserting in between (so every rank always runs the same
collectives): the output, the input gradient, the router gradient (summed
over ranks), every local expert's gradients, the routing statistics, and
every all-to-all (``CollectiveLog``): phase, rows per rank, bytes.
Variants: ``as_written``; ``rows_out_of_order`` (the dispatched rows
no longer in the order the splits describe); ``return_without_autograd``
(the return all-to-all done with a plain collective, so no gradient goes
back through it); ``torch`` (PyTorch's ``all_to_all_single_autograd`` as
the exchange, counted with ``CommDebugMode``).

    torchrun --nproc_per_node=2 tests/workers/expert_parallel_check.py
"""

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import worker_checks  # tests/workers/, the script's folder
from torch.distributed.tensor.debug import CommDebugMode

from ddp_course import expert_parallel as ep
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(
    d_model=8,
    hidden=16,
    experts=4,
    k=2,
    tokens=12,  # tokens per rank
    capacity_factor=1.0,
    aux_weight=0.5,
)

TOL = {"rtol": 1e-12, "atol": 1e-12}  # float64, the same operations in another order


mismatch = functools.partial(worker_checks.mismatch, **TOL)


def whole_moe(capacity_factor=None):
    torch.manual_seed(0)
    factor = args.capacity_factor if capacity_factor is None else capacity_factor
    return ep.MoE(args.d_model, args.hidden, args.experts, args.k, factor).double()


def global_batch(world_size):
    gen = torch.Generator().manual_seed(1)
    n = args.tokens * world_size
    x = torch.randn(n, args.d_model, generator=gen, dtype=torch.float64)
    w = torch.randn(n, args.d_model, generator=gen, dtype=torch.float64)
    return x, w


def torch_exchange(x, output_splits, input_splits, group):
    return funcol.wait_tensor(
        funcol.all_to_all_single_autograd(x, output_splits, input_splits, group or dist.group.WORLD)
    )


def broken_exchange(variant):
    """Our all-to-all, with the mistake ``variant`` names put into one of its two calls."""
    calls = []

    def exchange(x, output_splits, input_splits, group):
        calls.append(1)
        dispatch = len(calls) % 2 == 1
        if variant == "rows_out_of_order" and dispatch:
            x = x.flip(0)  # the same rows and splits, but not in the order the router sorted
        if variant == "return_without_autograd" and not dispatch:
            out = x.new_empty((sum(output_splits), *x.shape[1:]))
            dist.all_to_all_single(out, x.detach(), output_splits, input_splits, group=group)
            return out
        return ep.all_to_all(x, output_splits, input_splits, group)

    return exchange


def dropped_by_hand(experts, keep_capacity):
    """Assignments dropped, counted one by one in GShard's priority order (choices first)."""
    used, dropped = {}, 0
    for choice in range(experts.shape[1]):
        for t in range(experts.shape[0]):
            e = int(experts[t, choice])
            used[e] = used.get(e, 0) + 1
            dropped += used[e] > keep_capacity
    return dropped


def check(ctx, variant):
    n, r = ctx.world_size, ctx.rank
    factor = float("inf") if variant == "dropless" else None  # capacity_factor=inf: no drops
    ref = whole_moe(factor)
    x, w = global_batch(n)
    mine = slice(r * args.tokens, (r + 1) * args.tokens)

    x_ref = x.clone().requires_grad_()
    y_ref, routings = ref(x_ref, groups=n)
    aux_ref = torch.stack([g.aux_loss for g in routings]).mean()
    ((y_ref * w).sum() + args.aux_weight * aux_ref).backward()
    y_global, _ = whole_moe(factor)(x, groups=1)  # capacity over the whole batch instead

    exchange = torch_exchange if variant == "torch" else broken_exchange(variant)
    layer = ep.ExpertParallelMoE(whole_moe(factor), r, n, exchange=exchange)
    log = CollectiveLog()
    x_par = x[mine].clone().requires_grad_()
    with CommDebugMode() as fwd, log.recording("forward"):
        y, routing, splits = layer(x_par)
    with CommDebugMode() as bwd, log.recording("backward"):
        ((y * w[mine]).sum() + args.aux_weight * routing.aux_loss / n).backward()
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # replicated: each rank holds its tokens' share

    ref_r = routings[r]
    fails = {
        "output": mismatch(y, y_ref[mine].detach()),
        "input_grad": mismatch(x_par.grad, x_ref.grad[mine]),
        "router_grad": mismatch(router_grad, ref.router.weight.grad),
        "aux_loss": mismatch(routing.aux_loss.detach(), ref_r.aux_loss.detach()),
        "tokens per expert": None if torch.equal(routing.routed, ref_r.routed) else "differ",
        "kept per expert": None if torch.equal(routing.kept, ref_r.kept) else "differ",
    }
    for i, e in enumerate(layer.local):
        for name, q in layer.experts[i].named_parameters():
            expected = ref.experts[e].get_parameter(name).grad
            got = torch.zeros_like(expected) if q.grad is None else q.grad
            fails[f"grad expert {e}.{name}"] = mismatch(got, expected)
    by_hand = dropped_by_hand(routing.experts, routing.capacity)
    fails["dropped = count by hand"] = (
        None if routing.dropped == by_hand else f"{routing.dropped} != {by_hand}"
    )

    per = args.experts // n
    dest = routing.experts[routing.keep] // per  # rank of each kept assignment's expert
    remote_rows = int((dest != r).sum())
    row_bytes = args.d_model * x.element_size()
    calls = [c for c in log.calls if c["op"] == "all_to_all"]
    sent_remote = [c["sent"] for c in calls if c["dtype"] == "torch.float64"]
    return {
        "fails": fails,
        "splits": splits,
        "calls": calls,
        "remote_rows": remote_rows,
        "expected_remote_bytes": remote_rows * row_bytes,
        "sent_remote_bytes": sent_remote,
        "rows_by_rank": [int((dest == q).sum()) for q in range(n)],
        "routed": routing.routed.tolist(),
        "kept": routing.kept.tolist(),
        "dropped": routing.dropped,
        "capacity": routing.capacity,
        "global_capacity_differs": mismatch(y, y_global[mine].detach()) is not None,
        "comm": {
            "forward": {str(k): v for k, v in fwd.get_comm_counts().items()},
            "backward": {str(k): v for k, v in bwd.get_comm_counts().items()},
        },
    }


with distributed(device="cpu") as ctx:
    out = {"world_size": ctx.world_size, "variants": {}}
    for variant in (
        "as_written",
        "rows_out_of_order",
        "return_without_autograd",
        "torch",
        "dropless",
    ):
        report = check(ctx, variant)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, report)
        out["variants"][variant] = gathered
    write_results(ctx, args.results, out)
