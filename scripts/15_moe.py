"""Mixture of experts with expert parallelism: uneven all-to-all, capacity, load balancing.

Run from the repository root:
    python scripts/15_moe.py
    torchrun --nproc_per_node=2 scripts/15_moe.py
    torchrun --nproc_per_node=4 scripts/15_moe.py --experts 8
    torchrun --nproc_per_node=4 scripts/15_moe.py --ep-ranks 2 --aux-weights

Every rank builds the same MoE layer (same seed) and keeps E / world_size of
its experts. Part 1, in float64: each rank routes its slice of one global
batch, sends every kept assignment to the rank holding its expert with
dist.all_to_all_single (split sizes from the routing, exchanged first), and
gets the results back with a second all-to-all. The script asserts that the
output and every gradient equal the one-process MoE with one capacity group
per rank, that PyTorch's all_to_all_single_autograd gives the same, and that
the bytes each rank sent to others (counted by the course's CollectiveLog)
equal the count from its routing. Then, under a router that sends every
token to expert 0 first: the dropless layer (capacity_factor=inf, uneven
splits) and GShard's capacity-padded exchange (equal splits, with and without
drops) against one process, each with the bytes it sent. Then EP x DP: the
ranks as a (world / --ep-ranks, --ep-ranks) mesh, experts spread along a row
and replicated down a column; a few SGD steps against one process, with the
expert gradients averaged over the right group, the wrong one, or none. Then
a shared expert (every token, beside the routed ones) against one process.
Part 2: a byte-level
language model (embedding, expert-parallel MoE, head) trains on Shakespeare
for each --aux-weights value, and the script reports the tokens per expert.
Results go to --results (rank 0).
"""

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ddp_course import expert_data_parallel as epdp
from ddp_course import expert_parallel as ep
from ddp_course import expert_parallel_dropless as dropless
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.harness.script_args import script_parser
from ddp_course.models import FeedForward, lm_loss
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results


def parse_args():
    meaning = {
        "d_model": "features in and out of the layer",
        "hidden": "hidden features of each expert",
        "batch_size": "sequences per rank per step",
        "steps": "training steps in part 2",
    }
    p = script_parser(__doc__, d_model=16, hidden=32, batch_size=8, seq_len=32, steps=60,
                      lr=1e-2, seed=0, results=None, help=meaning)
    p.add_argument("--experts", type=int, default=4, help="E, a multiple of the world size")
    p.add_argument("--k", type=int, default=2, help="experts per token in part 1")
    p.add_argument("--capacity-factor", type=float, default=1.0, help="part 1's capacity factor")
    p.add_argument("--tokens", type=int, default=24, help="tokens per rank in part 1")
    p.add_argument("--ep-ranks", type=int, default=0,
                   help="ranks per expert-parallel group, EP x DP check (0: all)")
    p.add_argument("--ep-dp-steps", type=int, default=3, help="SGD steps of the EP x DP check")
    p.add_argument("--router-skew", type=float, default=0.3,
                   help="part 2 starts with the router leaning to expert 0")
    p.add_argument("--aux-weights", type=float, nargs="*", default=[0.0, 0.1],
                   help="load-balancing loss weights for part 2 (none: skip it)")
    return p.parse_args()


def torch_all_to_all(x, output_splits, input_splits, group):
    """PyTorch's differentiable uneven all-to-all (its backward is the reverse exchange)."""
    group = group or dist.group.WORLD
    return funcol.wait_tensor(
        funcol.all_to_all_single_autograd(x, output_splits, input_splits, group)
    )


def whole_moe(args, k, capacity_factor, dtype=torch.float32):
    torch.manual_seed(args.seed)  # the same layer on every rank
    return ep.MoE(args.d_model, args.hidden, args.experts, k, capacity_factor).to(dtype)


def max_over_ranks(ctx, value):
    """The largest ``value`` over the ranks (a Python float)."""
    # On ctx.device: nccl takes CUDA tensors only, a CPU tensor is refused.
    t = torch.tensor(float(value), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def expert_parallel_run(layer, x, w, n):
    """Output, input grad, router grad (summed over ranks), expert grads; rank's loss share."""
    x = x.clone().requires_grad_()
    y, routing, splits = layer(x)
    ((y * w).sum() + routing.aux_loss / n).backward()
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)  # replicated: each rank holds its own tokens' share
    experts = [q.grad for e in layer.experts for q in e.parameters()]
    return y, x.grad, router, experts, routing, splits


def ref_copy(args, dev, capacity_factor=None, skew=0.0):
    factor = args.capacity_factor if capacity_factor is None else capacity_factor
    moe = whole_moe(args, args.k, factor, torch.float64).to(dev)
    with torch.no_grad():
        moe.router.weight[0] += skew  # with inputs near +1: everyone's first choice
    return moe


def one_process(ref, x, w, n):
    """The whole batch in one process, one capacity group per rank: output, input grad."""
    x_ref = x.clone().requires_grad_()
    y_ref, groups = ref(x_ref, groups=n)
    ((y_ref * w).sum() + torch.stack([g.aux_loss for g in groups]).mean()).backward()
    return y_ref, x_ref.grad, groups


def differences(ctx, run, y_ref, xg_ref, router_ref, expert_refs):
    """Largest |a - b| over the ranks, per quantity, of a run against another."""
    y, xg, router, experts = run[:4]
    diffs = {
        "output": (y - y_ref).abs().max().item(),
        "input gradient": (xg - xg_ref).abs().max().item(),
        "router gradient": (router - router_ref).abs().max().item(),
        "expert gradients": max((a - b).abs().max().item() for a, b in zip(experts, expert_refs)),
    }
    return {k: max_over_ranks(ctx, v) for k, v in diffs.items()}


def float64_sent(log):
    """Bytes sent to other ranks by each float64 all-to-all (the int64 counts left out)."""
    return [
        c["sent"] for c in log.calls if c["op"] == "all_to_all" and c["dtype"] == "torch.float64"
    ]


def check(args, ctx):
    """Part 1: expert parallel against one process in float64, bytes against the routing."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    gen = torch.Generator().manual_seed(1)  # the same global batch on every rank
    x = torch.randn(n * args.tokens, args.d_model, generator=gen, dtype=torch.float64).to(dev)
    w = torch.randn(n * args.tokens, args.d_model, generator=gen, dtype=torch.float64).to(dev)
    mine = slice(r * args.tokens, (r + 1) * args.tokens)

    ref = ref_copy(args, dev)
    # Capacity per rank's tokens, as expert parallel does.
    y_ref, xg_ref, groups = one_process(ref, x, w, n)

    # NEW: the experts spread over the ranks, tokens exchanged by all-to-all.
    log = CollectiveLog()
    ours = ep.ExpertParallelMoE(ref_copy(args, dev), r, n).to(dev)
    with log.recording():
        y, xg, router, experts, routing, splits = expert_parallel_run(ours, x[mine], w[mine], n)
    ref_experts = [q.grad for e in ours.local for q in ref.experts[e].parameters()]
    diffs = differences(ctx, (y, xg, router, experts), y_ref[mine], xg_ref[mine],
                        ref.router.weight.grad, ref_experts)

    theirs = ep.ExpertParallelMoE(ref_copy(args, dev), r, n, exchange=torch_all_to_all).to(dev)
    torch_run = expert_parallel_run(theirs, x[mine], w[mine], n)
    torch_diffs = differences(ctx, torch_run, y, xg, router, experts)

    # Bytes this rank sent to other ranks, measured per call, and as the routing says.
    per = args.experts // n
    dest = routing.experts[routing.keep] // per
    # The float64 exchanges (the int64 split counts go first).
    measured = float64_sent(log)
    mine_report = {
        "rank": r, "send": splits["send"], "receive": splits["receive"],
        "routed": routing.routed.tolist(), "kept": routing.kept.tolist(),
        "dropped": routing.dropped, "capacity": routing.capacity,
        "measured_bytes_to_others": measured,
        "routing_bytes_to_others": int((dest != r).sum()) * args.d_model * 8,
    }
    per_rank = [None] * n
    dist.all_gather_object(per_rank, mine_report)
    return {"diffs": diffs, "torch_diffs": torch_diffs, "per_rank": per_rank,
            "reference_routed": [g.routed.tolist() for g in groups],
            "reference_dropped": [g.dropped for g in groups]}


EXCHANGES = {  # name: (layer class, capacity factor; None: --capacity-factor)
    "dropless": (ep.ExpertParallelMoE, float("inf")),
    "padded, no drops": (dropless.PaddedExpertParallelMoE, float("inf")),
    "padded": (dropless.PaddedExpertParallelMoE, None),
}


def exchange_check(args, ctx, skew=0.5):
    """Dropless against capacity-padded exchanges under a skewed router: float64, bytes."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    gen = torch.Generator().manual_seed(3)
    # Inputs near +1 and expert 0's router row raised: every token's first choice is 0.
    x = torch.randn(n * args.tokens, args.d_model, generator=gen, dtype=torch.float64) + 1
    w = torch.randn(n * args.tokens, args.d_model, generator=gen, dtype=torch.float64)
    x, w, mine = x.to(dev), w.to(dev), slice(r * args.tokens, (r + 1) * args.tokens)
    rows = {}
    for name, (layer_class, factor) in EXCHANGES.items():
        ref = ref_copy(args, dev, factor, skew)
        y_ref, xg_ref, groups = one_process(ref, x, w, n)
        layer = layer_class(ref_copy(args, dev, factor, skew), r, n).to(dev)
        log = CollectiveLog()
        with log.recording():
            run = expert_parallel_run(layer, x[mine], w[mine], n)
        routing = run[4]
        refs = [q.grad for e in layer.local for q in ref.experts[e].parameters()]
        report = {
            "rank": r, "capacity": routing.capacity, "dropped": routing.dropped,
            "routed": routing.routed.tolist(),
            "all_to_alls": [c["dtype"] for c in log.calls if c["op"] == "all_to_all"],
            "measured_bytes_to_others": float64_sent(log),
            "routed_bytes_to_others":
                dropless.routed_rows_to_others(routing, r, n) * args.d_model * 8,
            "padded_bytes_to_others":
                dropless.padded_rows_to_others(routing.capacity, args.experts, n)
                * args.d_model * 8,
        }
        per_rank = [None] * n
        dist.all_gather_object(per_rank, report)
        rows[name] = {
            "capacity_factor": factor or args.capacity_factor,
            "diffs": differences(
                ctx, run, y_ref[mine], xg_ref[mine], ref.router.weight.grad, refs
            ),
            "reference_dropped": sum(g.dropped for g in groups),
            "per_rank": per_rank,
        }
    return {"skew": skew, "rows": rows}


def shared_check(args, ctx):
    """A shared expert beside the routed ones: expert parallel against one process, float64."""
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    gen = torch.Generator().manual_seed(5)
    x, w = (torch.randn(n * args.tokens, args.d_model, generator=gen, dtype=torch.float64).to(dev)
            for _ in range(2))
    mine = slice(r * args.tokens, (r + 1) * args.tokens)

    def shared_expert():
        torch.manual_seed(args.seed + 1)
        return FeedForward(args.d_model, args.hidden).to(torch.float64).to(dev)

    ref_moe, ref_shared = ref_copy(args, dev), shared_expert()

    def ref(tokens, groups):  # written out: the routed experts' output plus the shared one's
        y, routings = ref_moe(tokens, groups=groups)
        return y + ref_shared(tokens), routings

    y_ref, xg_ref, _ = one_process(ref, x, w, n)
    ours = ep.SharedExpertMoE(ep.ExpertParallelMoE(ref_copy(args, dev), r, n), shared_expert())
    x_mine = x[mine].clone().requires_grad_()
    y, routing, _ = ours.to(dev)(x_mine)
    ((y * w[mine]).sum() + routing.aux_loss / n).backward()
    shared, shared_ref = list(ours.shared.parameters()), list(ref_shared.parameters())
    own_share = max((a.grad - b.grad).abs().max().item() for a, b in zip(shared, shared_ref))
    for q in [ours.moe.router.weight, *shared]:  # dense: every rank holds it whole
        dist.all_reduce(q.grad)
    routed = [q for e in ours.moe.local for q in ref_moe.experts[e].parameters()]
    diffs = {
        "output": (y - y_ref[mine]).abs().max().item(),
        "input gradient": (x_mine.grad - xg_ref[mine]).abs().max().item(),
        "router gradient": (ours.moe.router.weight.grad - ref_moe.router.weight.grad)
        .abs()
        .max()
        .item(),
        "shared expert gradients": max(
            (a.grad - b.grad).abs().max().item() for a, b in zip(shared, shared_ref)
        ),
        "routed expert gradients": max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(ours.moe.experts.parameters(), routed)
        ),
    }
    return {"diffs": {k: max_over_ranks(ctx, v) for k, v in diffs.items()},
            "shared_gradient_not_summed": max_over_ranks(ctx, own_share)}


def sgd(params, lr):
    with torch.no_grad():
        for q in params:
            q -= lr * q.grad
            q.grad = None


EP_DP_REDUCTIONS = ("over the DP group", "over the EP group", "not over the DP group")


def ep_dp_check(args, ctx, lr=0.1):
    """EP x DP against one process: parameters after a few SGD steps, float64.

    Each rank's loss is the mean over its own tokens; the one-process loss the mean
    of the ranks'. The expert gradients are averaged over the DP group (right), over
    the EP group (the wrong group), or only within the EP group (no DP reduction).
    """
    n, dev = ctx.world_size, ctx.device
    size = args.ep_ranks or n
    mesh = epdp.expert_data_parallel_mesh(dev.type, n, size)
    ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
    ep_rank = mesh.get_local_rank("ep")
    gen = torch.Generator().manual_seed(4)  # the same global batches on every rank
    batches = [
        [torch.randn(n * args.tokens, args.d_model, generator=gen, dtype=torch.float64).to(dev)
         for _ in range(2)] for _ in range(args.ep_dp_steps)
    ]
    mine = slice(ctx.rank * args.tokens, (ctx.rank + 1) * args.tokens)

    ref = ref_copy(args, dev)
    for x, w in batches:
        y, groups = ref(x, groups=n)
        aux = torch.stack([g.aux_loss for g in groups])
        (((y * w).sum() / args.tokens + aux.sum()) / n).backward()
        sgd(ref.parameters(), lr)

    diffs = {}
    for name in EP_DP_REDUCTIONS:
        layer = ep.ExpertParallelMoE(ref_copy(args, dev), ep_rank, size, group=ep_group).to(dev)
        experts = list(layer.experts.parameters())
        log = CollectiveLog(mesh)
        for step, (x, w) in enumerate(batches):
            y, routing, _ = layer(x[mine])
            ((y * w[mine]).sum() / args.tokens + routing.aux_loss).backward()
            with log.recording() if step == 0 else contextlib.nullcontext():
                if name == "not over the DP group":  # the mean over the EP group's ranks only
                    epdp.average_gradients([], layer.router.parameters(), None, n)
                    for q in experts:
                        q.grad.div_(size)
                else:
                    group = dp_group if name == "over the DP group" else ep_group
                    epdp.average_gradients(experts, layer.router.parameters(), group, n)
            sgd(layer.parameters(), lr)
        ref_experts = [q for e in layer.local for q in ref.experts[e].parameters()]
        with torch.no_grad():
            router = (layer.router.weight - ref.router.weight).abs().max().item()
            worst = max((a - b).abs().max().item() for a, b in zip(experts, ref_experts))
        diffs[name] = {
            "router": max_over_ranks(ctx, router),
            "experts": max_over_ranks(ctx, worst),
            # One step's all-reduces, by the mesh dimensions their group spans.
            "all_reduces": dict(Counter(c["dims"] for c in log.calls)),
        }
    layout = [None] * n
    dist.all_gather_object(layout, {"rank": ctx.rank, "ep_rank": ep_rank,
                                    "dp_rank": mesh.get_local_rank("dp"),
                                    "experts": list(layer.local)})
    return {"mesh": [n // size, size], "steps": args.ep_dp_steps, "layout": layout,
            "diffs": diffs}


def train(args, ctx, aux_weight, text):
    """Part 2: a byte-level LM with an expert-parallel top-1 MoE; tokens per expert."""
    n, dev = ctx.world_size, ctx.device
    torch.manual_seed(args.seed)
    emb, head = nn.Embedding(256, args.d_model).to(dev), nn.Linear(args.d_model, 256).to(dev)
    whole = whole_moe(args, 1, 1.25).to(dev)
    with torch.no_grad():
        # A shared direction in every token's embedding, and expert 0's router row
        # leaning along it: training starts with the router collapsed onto expert 0.
        emb.weight += 1.0
        whole.router.weight[0] += args.router_skew
    moe = ep.ExpertParallelMoE(whole, ctx.rank, n).to(dev)
    replicated = [*emb.parameters(), *head.parameters(), *moe.router.parameters()]
    opt = torch.optim.Adam([*replicated, *moe.experts.parameters()], lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own batches
    cv, losses, per_step, probs = [], [], [], []
    for _ in range(args.steps):
        x, y = (t.to(dev) for t in lm_batch(text, args.batch_size, args.seq_len, gen))
        h = emb(x)
        out, routing, _ = moe(h)
        loss = lm_loss(head(h + out), y)  # the residual carries dropped tokens
        # This rank's share of the global mean; the experts' gradients arrive summed over
        # ranks through the reverse all-to-all, the replicated ones are summed here.
        ((loss + aux_weight * routing.aux_loss) / n).backward()
        for q in replicated:
            dist.all_reduce(q.grad)
        opt.step()
        opt.zero_grad()
        counts = torch.cat([routing.routed.to(torch.float64), routing.probs.detach().mean(0) / n])
        dist.all_reduce(counts)  # tokens per expert, and mean router probability, all ranks
        counts, p = counts[: args.experts], counts[args.experts :]
        cv.append((counts.std(unbiased=False) / counts.mean()).item())
        losses.append(loss.item())
        per_step.append(counts.long().tolist())
        probs.append(p.tolist())
    with torch.no_grad():  # a held-out batch, the same seed for every weight
        x, _ = lm_batch(text, args.batch_size, args.seq_len, torch.Generator().manual_seed(7))
        _, routing, _ = moe(emb(x.to(dev)))
    stats = torch.stack([routing.routed, routing.kept]).to(torch.float64)
    dist.all_reduce(stats)
    routed, kept = stats[0], stats[1]
    return {"aux_weight": aux_weight, "routed": routed.long().tolist(),
            "kept": kept.long().tolist(), "dropped": int((routed - kept).sum()),
            "cv": (routed.std(unbiased=False) / routed.mean()).item(),
            "cv_last_10_steps": sum(cv[-10:]) / len(cv[-10:]),
            "max_over_mean": (routed.max() / routed.mean()).item(),
            "cv_per_step": cv, "loss_per_step": losses, "routed_per_step": per_step,
            "mean_prob_per_step": probs}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        ep.experts_of_rank(args.experts, ctx.world_size, ctx.rank)  # clear error, early
        result = {"world_size": ctx.world_size, "device": str(ctx.device),
                  "d_model": args.d_model, "experts": args.experts, "k": args.k,
                  "capacity_factor": args.capacity_factor, "tokens": args.tokens}
        result.update(check(args, ctx))
        result["exchanges"] = exchange_check(args, ctx)
        result["ep_dp"] = ep_dp_check(args, ctx)
        result["shared_expert"] = shared_check(args, ctx)
        log.info(f"{ctx.world_size} ranks: |expert parallel - one process| <= "
                 f"{max(result['diffs'].values()):.1e}, |all_to_all_single_autograd - ours| "
                 f"<= {max(result['torch_diffs'].values()):.1e}")
        text = shakespeare_bytes("train").to(ctx.device)
        result["training"] = [train(args, ctx, w, text) for w in args.aux_weights]
        for t in result["training"]:
            log.info(f"aux weight {t['aux_weight']}: tokens per expert {t['routed']}, "
                     f"CV {t['cv']:.2f}, dropped {t['dropped']}")
        write_results(ctx, args.results, result)


if __name__ == "__main__":
    main()
