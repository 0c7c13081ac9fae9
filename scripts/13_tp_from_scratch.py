"""Tensor-parallel attention and sequence parallelism from scratch, on TinyGPT.

Run from the repository root:
    python scripts/13_tp_from_scratch.py
    torchrun --nproc_per_node=2 scripts/13_tp_from_scratch.py
    torchrun --nproc_per_node=4 scripts/13_tp_from_scratch.py --n-heads 8
On a machine with GPUs but fewer than the ranks launched, every rank must run on the CPU:
    DDP_COURSE_DEVICE=cpu torchrun --nproc_per_node=2 scripts/13_tp_from_scratch.py

Every rank builds the same TinyGPT in float64 and splits each block over all
ranks: attention heads and MLP hidden features by Megatron-LM's column/row
split (TP), and, with sequence parallelism (SP), the LayerNorm and dropout
regions along the sequence. The script asserts that one block (forward and
backward) and the whole model after --steps SGD steps equal one process,
with and without SP; counts every all-reduce, all-gather and reduce-scatter
against the formula; measures the bytes the LayerNorms and a whole block keep for backward (against
Korthikanti et al. 2022); and runs three labs: ranks initialised with
different seeds, dropout masks across ranks and steps, and the LayerNorm
gradients of SP never all-reduced. Results go to --results (rank 0).
"""

import argparse

import torch
import torch.distributed as dist

from ddp_course import sequence_parallel as sp
from ddp_course import tensor_parallel as tp
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.mesh_predictions import saved_block_bytes_formula
from ddp_course.models import Block, TinyGPT, lm_loss
from ddp_course.parallel_gpt import ParallelGPT, gather_full_state
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results
from ddp_course.tools.saved_tensors import saved_activation_bytes

BLOCK_TOL, GPT_TOL = 1e-12, 1e-10  # float64: a block's rounding, then 5 steps of it


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=32, help="model width d")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads (split over ranks)")
    p.add_argument("--n-layers", type=int, default=2, help="Transformer blocks")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sample T (split with SP)")
    p.add_argument("--batch-size", type=int, default=4, help="samples B (not split)")
    p.add_argument("--steps", type=int, default=5, help="SGD steps of the whole model")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


def whole_gpt(args, device, seed=0):
    torch.manual_seed(seed)  # the same weights on every rank
    return TinyGPT(d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
                   seq_len=args.seq_len, flash=False).double().to(device)  # fmt: skip


def max_diff(a, b, tol):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return (a - b).abs().max().item()


def my_part(x, ctx):
    return x.chunk(ctx.world_size, dim=1)[ctx.rank]


def block_check(args, ctx, sequence_parallel):
    """One block, forward and backward, against one process; its collectives per phase."""
    torch.manual_seed(0)
    ref = Block(args.d_model, args.n_heads, flash=False).double().to(ctx.device)
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
    grads = gather_full_state(par, grads=True)
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
    # Korthikanti et al. 2022, sec. 4.2.2: g and g-bar, twice each way, and in backward the
    # inputs of q/k/v and fc1 gathered again (only this rank's shard was saved); then the
    # 6 d replicated parameters acting on sequence shards (2 LayerNorms, 2 biases).
    return {
        "forward": {"all_gather": [k, k], "reduce_scatter": [k, k]},
        "backward": {"all_gather": [k] * 4, "reduce_scatter": [k, k]},
        "after backward": {"all_reduce": [6 * args.d_model * 8]},
    }


def ring_bytes_per_rank(calls, n):
    """The ring model of the counted calls: each rank sends 2(N-1)/N K per all-reduce and
    (N-1)/N K per all-gather or reduce-scatter (a model, not a measurement)."""
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
    par = ParallelGPT(whole_gpt(args, ctx.device, model_seed), ctx.rank, ctx.world_size,
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
    return gather_full_state(par), log.summary("step 0"), losses, par


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


def dropout_lab(args, ctx, seed=7):
    """Dropout masks of ParallelGPT (dropout 0.5) on every rank, two steps, three ways of
    seeding the sharded regions: per region, are they equal on every rank, and does a
    rank draw the same mask again at the next step?"""
    ways = {
        "one seed for every rank": lambda: tp.ParallelRNG(seed, rank=0),
        "per-rank seed, seeded again each step": lambda: tp.ParallelRNG(seed, ctx.rank),
        "ParallelRNG (per-rank state, kept)": lambda: tp.ParallelRNG(seed, ctx.rank),
    }
    out = {}
    for way, new_rng in ways.items():
        for layout, seq_par in (("TP", False), ("TP+SP", True)):
            torch.manual_seed(seed)  # the weights and the default generator: equal everywhere
            whole = TinyGPT(
                d_model=args.d_model,
                n_heads=args.n_heads,
                n_layers=args.n_layers,
                seq_len=args.seq_len,
                dropout=0.5,
                flash=False,
            ).double()
            par = ParallelGPT(
                whole.to(ctx.device),
                ctx.rank,
                ctx.world_size,
                sequence_parallel=seq_par,
                rng=new_rng(),
            )
            x, y = text_batch(args, ctx.device)
            steps = []
            for _ in range(2):
                if way.startswith("per-rank seed"):
                    par.rng.states.clear()  # region_seed's state from its start again
                with sp.dropout_masks() as masks:
                    lm_loss(par(x), y).backward()
                steps.append(masks)
            residual = "sequence shard" if seq_par else "replicated residual"
            names = ["replicated embeddings", *["heads", residual, residual] * args.n_layers]
            for i, region in enumerate(names):
                row = out.setdefault((way, layout, region), [True, False])
                for masks in steps:
                    copies = [torch.empty_like(masks[i]) for _ in range(ctx.world_size)]
                    dist.all_gather(copies, masks[i])
                    row[0] &= all(torch.equal(c, copies[0]) for c in copies)
                row[1] |= torch.equal(steps[0][i], steps[1][i])
    return [
        {
            "seeding": w,
            "layout": lay,
            "region": r,
            "equal on every rank": eq,
            "same mask next step": again,
        }
        for (w, lay, r), (eq, again) in out.items()
    ]


def saved_block_bytes(args, ctx, seq_par):
    """Bytes one whole block (dropout 0.1, explicit attention) saves for backward here."""
    torch.manual_seed(0)
    whole = Block(args.d_model, args.n_heads, dropout=0.1, flash=False).double()
    par = sp.ParallelBlock(whole, ctx.rank, ctx.world_size, sequence_parallel=seq_par)
    par = par.to(ctx.device)
    x = torch.randn(args.batch_size, args.seq_len, args.d_model, dtype=torch.float64,
                    device=ctx.device)  # fmt: skip
    x = (my_part(x, ctx) if seq_par else x).requires_grad_()
    out = {}
    with saved_activation_bytes([par], out):
        y = par(x)
    y.sum().backward()
    whole_shape = [[args.batch_size, args.seq_len, args.d_model],
                   [args.batch_size * args.seq_len, args.d_model]]  # fmt: skip
    # CUDA's fused dropout keeps a 1-byte mask; the CPU's a float64 one.
    mask = 1 if ctx.device.type == "cuda" else 8
    formula = saved_block_bytes_formula(
        args.batch_size, args.seq_len, args.d_model, args.n_heads, ctx.world_size, seq_par, 8, mask
    )
    return {"bytes": out["bytes"], "formula": formula,
            "whole [B, T, d] kept": sum(s in whole_shape for s in out["shapes"])}  # fmt: skip


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        n = ctx.world_size
        result = {"world_size": n, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "d_model": args.d_model, "heads": args.n_heads, "layers": args.n_layers,
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
            whole = Block(args.d_model, args.n_heads).double()
            par = sp.ParallelBlock(whole, ctx.rank, n, sequence_parallel=seq_par).to(ctx.device)
            x = torch.randn(args.batch_size, args.seq_len, args.d_model, dtype=torch.float64,
                            device=ctx.device)  # fmt: skip
            x = (my_part(x, ctx) if seq_par else x).requires_grad_()
            out = {}
            with saved_activation_bytes([par.ln1, par.ln2], out):
                par(x).sum().backward()
            saved[name] = out["bytes"]
        result["layernorm_saved_bytes"] = saved

        # A whole block: what autograd keeps for backward, against Korthikanti et al. 2022.
        result["block_saved_bytes"] = {
            name: saved_block_bytes(args, ctx, seq_par)
            for name, seq_par in (("TP", False), ("TP+SP", True))
        }

        # Lab 1: each rank builds its own model with seed + rank, then keeps its shard.
        labs = {}
        replicated = ["tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight", "head.weight"]
        for case, seed in (("seed + rank", ctx.rank), ("same seed", 0)):
            par = ParallelGPT(whole_gpt(args, ctx.device, seed), ctx.rank, n)
            one = dict(whole_gpt(args, ctx.device, 0).named_parameters())
            mine = dict(par.named_parameters())
            # This rank's replicated copies against the one-process model, on every rank.
            by_rank = [None] * n
            gap = max((mine[k] - one[k]).abs().max().item() for k in replicated)
            dist.all_gather_object(by_rank, gap)
            labs[case] = {"replicated vs one process, by rank": by_rank,
                          "replicated spread across ranks":
                              max(spread_across_ranks(par, replicated).values())}  # fmt: skip
        result["seed_lab"] = labs
        result["dropout_lab"] = dropout_lab(args, ctx)
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
                 f"per block (ring model) forward {tp['ring_bytes']['forward']} (TP) and "
                 f"{tpsp['ring_bytes']['forward']} (TP+SP)")  # fmt: skip
        write_results(ctx, args.results, result, args=vars(args))


if __name__ == "__main__":
    main()
