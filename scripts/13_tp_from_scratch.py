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

from ddp_course import parallel_gpt_runs as runs
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools import parallel_gpt_counts as counts
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

BLOCK_TOL, GPT_TOL = 1e-12, 1e-10  # float64: a block's rounding, then 5 steps of it
LAYOUTS = (("TP", False), ("TP+SP", True))  # (name, sequence parallel)


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


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        n = ctx.world_size
        result = {"world_size": n, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "d_model": args.d_model, "heads": args.n_heads, "layers": args.n_layers,
                  "steps": args.steps, "block": {}, "gpt": {}}
        ref = runs.reference_training(args, ctx.device)
        for name, seq_par in LAYOUTS:
            block = counts.block_check(args, ctx, seq_par, BLOCK_TOL)
            block["formula"] = runs.block_formula(args, n, seq_par)
            assert block["calls"] == block["formula"], (block["calls"], block["formula"])
            block["ring_bytes"] = {
                ph: counts.ring_bytes_per_rank(c, n) for ph, c in block["calls"].items()
            }
            result["block"][name] = block
            step_log = CollectiveLog()
            full, losses, _ = runs.train(args, ctx, seq_par, recording=step_log.recording)
            diff = max(runs.max_diff(full[k], q, GPT_TOL) for k, q in ref.items())
            result["gpt"][name] = {"max_diff_after_steps": diff,
                                   "calls_per_step": step_log.summary("step 0"),
                                   "losses": losses}
        # What autograd keeps for backward: the LayerNorms, then a whole block against
        # Korthikanti et al. 2022.
        result["layernorm_saved_bytes"] = {
            name: counts.layernorm_saved_bytes(args, ctx, seq_par) for name, seq_par in LAYOUTS
        }
        result["block_saved_bytes"] = {
            name: counts.saved_block_bytes(args, ctx, seq_par) for name, seq_par in LAYOUTS
        }
        result["seed_lab"] = runs.seed_lab(args, ctx)
        result["dropout_lab"] = runs.dropout_lab(args, ctx)
        result["ln_grad_lab"] = runs.ln_grad_lab(args, ctx, ref)

        tp, tpsp = result["block"]["TP"], result["block"]["TP+SP"]
        log.info(f"{n} ranks: block |TP - one process| <= {max(tp['diffs'].values()):.1e}, "
                 f"|TP+SP - one process| <= {max(tpsp['diffs'].values()):.1e}; after "
                 f"{args.steps} steps {result['gpt']['TP']['max_diff_after_steps']:.1e} and "
                 f"{result['gpt']['TP+SP']['max_diff_after_steps']:.1e}; bytes sent per rank "
                 f"per block (ring model) forward {tp['ring_bytes']['forward']} (TP) and "
                 f"{tpsp['ring_bytes']['forward']} (TP+SP)")
        write_results(ctx, args.results, result, args=vars(args))


if __name__ == "__main__":
    main()
