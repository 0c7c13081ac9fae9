"""Tensor-parallel attention and sequence parallelism from scratch, on TinyGPT.

Run from the repository root:
    python scripts/13_tp_from_scratch.py
    torchrun --nproc_per_node=2 scripts/13_tp_from_scratch.py
    torchrun --nproc_per_node=4 scripts/13_tp_from_scratch.py --heads 8

Every rank builds the same TinyGPT in float64 and splits each block over all
ranks: attention heads and MLP hidden features by Megatron-LM's column/row
split (TP), and, with sequence parallelism (SP), the LayerNorm and dropout
regions along the sequence. The script asserts that one block (forward and
backward) and the whole model after --steps SGD steps equal one process,
with and without SP; counts every all-reduce, all-gather and reduce-scatter
against the formula; measures the bytes the LayerNorms keep for backward;
and runs two labs: ranks initialised with different seeds, and the
LayerNorm gradients of SP never all-reduced. Results go to --results (rank 0).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

from ddp_course import sequence_parallel as sp
from ddp_course.comm_cost import CollectiveLog
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.models import Block, TinyGPT, lm_loss
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.records import write_results

BLOCK_TOL, GPT_TOL = 1e-12, 1e-10  # float64: a block's rounding, then 5 steps of it


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=32, help="model width d")
    p.add_argument("--heads", type=int, default=4, help="attention heads (split over ranks)")
    p.add_argument("--layers", type=int, default=2, help="Transformer blocks")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sample T (split with SP)")
    p.add_argument("--batch-size", type=int, default=4, help="samples B (not split)")
    p.add_argument("--steps", type=int, default=5, help="SGD steps of the whole model")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


def whole_gpt(args, device, seed=0):
    torch.manual_seed(seed)  # the same weights on every rank
    return TinyGPT(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                   seq_len=args.seq_len, flash=False).double().to(device)  # fmt: skip


def max_diff(a, b, tol):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return (a - b).abs().max().item()


def my_part(x, ctx):
    return x.chunk(ctx.world_size, dim=1)[ctx.rank]


def block_check(args, ctx, sequence_parallel):
    """One block, forward and backward, against one process; its collectives per phase."""
    torch.manual_seed(0)
    ref = Block(args.d_model, args.heads, flash=False).double().to(ctx.device)
    # NEW: heads and hidden features split over the ranks; with SP also the sequence.
    par = sp.ParallelBlock(ref, ctx.rank, ctx.world_size, sequence_parallel=sequence_parallel)
    par = par.to(ctx.device)  # already there: built from ref's weights
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.seq_len, args.d_model)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(ctx.device).requires_grad_()
    ((ref(x) - 1) ** 2).sum().backward()
    x_par = x.detach().clone().requires_grad_()
    x_in = my_part(x_par, ctx) if sequence_parallel else x_par
    log = CollectiveLog()
    with log.recording("forward"):
        out = par(x_in)
    with log.recording("backward"):
        ((out - 1) ** 2).sum().backward()
    with log.recording("after backward"):
        sp.all_reduce_sequence_parallel_grads(par)  # nothing to do without SP
    part = my_part if sequence_parallel else (lambda t, _: t)
    grads = sp.gather_full_state(par, grads=True)
    diffs = {"output": max_diff(out, part(ref(x), ctx), BLOCK_TOL),
             "input gradient": max_diff(part(x_par.grad, ctx), part(x.grad, ctx), BLOCK_TOL),
             "parameter gradients": max(max_diff(grads[n], q.grad, BLOCK_TOL)
                                        for n, q in ref.named_parameters())}  # fmt: skip
    return {"diffs": diffs, "calls": {ph: log.summary(ph) for ph in
                                      ("forward", "backward", "after backward")}}  # fmt: skip


def block_formula(args, n, sequence_parallel):
    """Collectives of one block per phase, {op: [bytes of the whole tensor]}, from the papers."""
    k = args.batch_size * args.seq_len * args.d_model * 8  # one [B, T, d] float64
    if n == 1:
        return {"forward": {}, "backward": {}, "after backward": {}}
    if not sequence_parallel:  # Shoeybi et al. 2019, sec. 3: g twice forward, f twice backward
        return {"forward": {"all_reduce": [k, k]}, "backward": {"all_reduce": [k, k]},
                "after backward": {}}  # fmt: skip
    # Korthikanti et al. 2022, sec. 4.2.2: g and g-bar, twice each way; then the
    # 6 d replicated parameters acting on sequence shards (2 LayerNorms, 2 biases).
    both = {"all_gather": [k, k], "reduce_scatter": [k, k]}
    return {
        "forward": both,
        "backward": both,
        "after backward": {"all_reduce": [6 * args.d_model * 8]},
    }


def ring_bytes_per_rank(calls, n):
    """Bytes each rank sends in a ring: 2(N-1)/N K per all-reduce, (N-1)/N K per gather/scatter."""
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    return sum(factor[op] * (n - 1) * k // n for op, ks in calls.items() for k in ks)


def text_batch(args, device):
    """The same batch of Shakespeare on every rank: ``int64 [B, T]`` inputs and targets."""
    gen = torch.Generator().manual_seed(2)  # the same start offsets on every rank
    tokens = shakespeare_bytes("train").to(device)
    x, y = lm_batch(tokens, args.batch_size, args.seq_len, gen)
    return x.to(device), y.to(device)


def train(args, ctx, sequence_parallel, model_seed=0, reduce_sp_grads=True):
    """--steps SGD steps on one batch; the gathered parameters and one step's collectives."""
    par = sp.ParallelGPT(whole_gpt(args, ctx.device, model_seed), ctx.rank, ctx.world_size,
                         sequence_parallel=sequence_parallel)  # fmt: skip
    opt = torch.optim.SGD(par.parameters(), lr=args.lr)
    x, y = text_batch(args, ctx.device)
    log, losses = CollectiveLog(), []
    for step in range(args.steps):
        with log.recording(f"step {step}"):
            loss = lm_loss(par(x), y)
            loss.backward()
            if reduce_sp_grads:
                sp.all_reduce_sequence_parallel_grads(par)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sp.gather_full_state(par), log.summary("step 0"), losses, par


def reference_training(args, device):
    """The same steps in one process, whole model."""
    ref = whole_gpt(args, device)
    opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    x, y = text_batch(args, device)
    for _ in range(args.steps):
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: q.detach() for n, q in ref.named_parameters()}


def spread_across_ranks(par, names):
    """Largest difference between ranks' copies of each replicated parameter."""
    out = {}
    params = dict(par.named_parameters())
    for name in names:
        copies = [torch.empty_like(params[name]) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, params[name].detach().contiguous())
        out[name] = max((c - copies[0]).abs().max().item() for c in copies)
    return out


def dropout_masks_agree(args, ctx, sharded, seed):
    """Do the N ranks draw the same dropout mask for a tensor of this region's shape?"""
    t = args.seq_len // ctx.world_size if sharded else args.seq_len
    torch.manual_seed(seed)
    ones = torch.ones(args.batch_size, t, args.d_model, device=ctx.device)
    mask = nn.functional.dropout(ones, 0.5)
    masks = [torch.empty_like(mask) for _ in range(ctx.world_size)]
    dist.all_gather(masks, mask)
    return all(torch.equal(m, masks[0]) for m in masks)


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        n = ctx.world_size
        result = {"world_size": n, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "d_model": args.d_model, "heads": args.heads, "layers": args.layers,
                  "steps": args.steps, "block": {}, "gpt": {}}  # fmt: skip
        ref = reference_training(args, ctx.device)
        for name, seq_par in (("TP", False), ("TP+SP", True)):
            block = block_check(args, ctx, seq_par)
            block["formula"] = block_formula(args, n, seq_par)
            assert block["calls"] == block["formula"], (block["calls"], block["formula"])
            block["ring_bytes"] = {
                ph: ring_bytes_per_rank(c, n) for ph, c in block["calls"].items()
            }
            result["block"][name] = block
            full, calls, losses, par = train(args, ctx, seq_par)
            diff = max(max_diff(full[k], q, GPT_TOL) for k, q in ref.items())
            result["gpt"][name] = {"max_diff_after_steps": diff, "calls_per_step": calls,
                                   "losses": losses}  # fmt: skip
        # The LayerNorms' saved activations, TP against TP+SP.
        saved = {}
        for name, seq_par in (("TP", False), ("TP+SP", True)):
            torch.manual_seed(0)
            whole = Block(args.d_model, args.heads).double()
            par = sp.ParallelBlock(whole, ctx.rank, n, sequence_parallel=seq_par).to(ctx.device)
            x = torch.randn(args.batch_size, args.seq_len, args.d_model, dtype=torch.float64,
                            device=ctx.device)  # fmt: skip
            x = (my_part(x, ctx) if seq_par else x).requires_grad_()
            out = {}
            with sp.saved_activation_bytes([par.ln1, par.ln2], out):
                par(x).sum().backward()
            saved[name] = out["bytes"]
        result["layernorm_saved_bytes"] = saved

        # Lab 1: each rank builds its own model with seed + rank, then keeps its shard.
        labs = {}
        for case, seed in (("seed + rank", ctx.rank), ("same seed", 0)):
            par = sp.ParallelGPT(whole_gpt(args, ctx.device, seed), ctx.rank, n)
            full, one = sp.gather_full_state(par), whole_gpt(args, ctx.device, 0)
            labs[case] = max((full[k] - q).abs().max().item() for k, q in one.named_parameters())
        result["seed_lab"] = labs
        result["dropout_lab"] = {
            f"{region}, {how}": dropout_masks_agree(args, ctx, sharded, seed)
            for region, sharded in (("replicated", False), ("sequence shard", True))
            for how, seed in (("same seed", 7), ("seed + rank", 7 + ctx.rank),
                              ("region_seed", sp.region_seed(7, ctx.rank, sharded)))
        }  # fmt: skip
        # Lab 2: sequence parallelism without the all-reduce of the LayerNorm gradients.
        lab2 = {}
        names = ["blocks.0.ln1.weight", "blocks.0.ln2.bias", "blocks.0.mlp.fc2.bias"]
        for case, reduce in (("not reduced", False), ("all-reduced", True)):
            full, _, _, par = train(args, ctx, True, reduce_sp_grads=reduce)
            drift = max((full[k] - q).abs().max().item() for k, q in ref.items())
            spread = max(spread_across_ranks(par, names).values())
            lab2[case] = {"spread across ranks": spread, "max diff from one process": drift}
        result["ln_grad_lab"] = lab2

        tp, tpsp = result["block"]["TP"], result["block"]["TP+SP"]
        log.info(f"{n} ranks: block |TP - one process| <= {max(tp['diffs'].values()):.1e}, "
                 f"|TP+SP - one process| <= {max(tpsp['diffs'].values()):.1e}; after "
                 f"{args.steps} steps {result['gpt']['TP']['max_diff_after_steps']:.1e} and "
                 f"{result['gpt']['TP+SP']['max_diff_after_steps']:.1e}; bytes sent per rank "
                 f"per block forward {tp['ring_bytes']['forward']} (TP) and "
                 f"{tpsp['ring_bytes']['forward']} (TP+SP)")  # fmt: skip
        write_results(ctx, args.results, result, args=vars(args))


if __name__ == "__main__":
    main()
