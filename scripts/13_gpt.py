"""TinyGPT on a device mesh: PyTorch's tensor, sequence, data and pipeline parallelism.

Run from the repository root:
    python scripts/13_gpt.py --steps 50
    torchrun --nproc_per_node=4 scripts/13_gpt.py --dp 2 --tp 2 --steps 200 --check
    torchrun --nproc_per_node=4 scripts/13_gpt.py --dp 4 --replicate 2 --check
    torchrun --nproc_per_node=4 scripts/13_gpt.py --suite --dtype float64 --steps 5
On a machine with GPUs but fewer than the ranks launched, every rank must run on the CPU:
    DDP_COURSE_DEVICE=cpu torchrun --nproc_per_node=4 scripts/13_gpt.py --dp 2 --tp 2

Training (default): TinyGPT trains on the bundled Shakespeare bytes with the
layout --pp x --dp x --tp (their product must equal the world size): every
data-parallel rank takes its --batch-size sequences of the global batch, the
tensor-parallel ranks split heads and MLP features (--sp: LayerNorms on a slice
of the sequence; --tp must divide --n-heads), the pipeline ranks split the blocks.
The --dp ranks run FSDP2, or HSDP with --replicate R: R replicas of --dp/R shards.
Every --eval-every steps (and before the first, after the last) the model's loss on
--eval-batches fixed batches of the held-out text (the plays' last tenth) is the
validation loss, the same on every rank (checked). With --check the same ranks
train DDP too (same weights, same batches) and the losses, validation losses and
final parameters are compared. Rank 0 samples text from the trained model and
writes the loss curves, tokens/s and, on a GPU in bfloat16, the MFU to --results
(the peak looked up by the exact device name, or given with --peak-flops).
tokens/s counts only the steps after the first --warmup ones (the first steps
build communicators and caches), timed with the GPU synchronised before each
clock read. --dtype bfloat16 is mixed precision: float32 master weights and
optimizer state, FSDP2's MixedPrecisionPolicy (bfloat16 compute, float32
gradient reduction), DDP under torch.autocast.

--suite (4 ranks, float64): every layout of ddp_course.mesh_layouts.LAYOUTS
trains --steps steps from the same weights on the same global batch and is
compared with one process; memory per rank against the formula; the collectives
of each layout's second step per phase and mesh dimension against the formula (and
of FSDP x TP keeping its gathered parameters); a DCP checkpoint
saved on the 2 x 2 mesh reloaded on 4 x 1 and in one process; and the loss
normalisation lab (padded sequences).
"""

import argparse
import functools
import logging
import warnings

import torch

from ddp_course import mesh_layouts as ml
from ddp_course import mesh_runs as runs
from ddp_course.runtime import distributed, get_logger, no_tf32
from ddp_course.tools import flops, mesh_counts, mesh_suite
from ddp_course.tools.records import write_results

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# FSDP2 warns that the root returns a view (we never change the logits in place).
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")  # --suite reruns
# Gathering FSDP x TP parameters whole takes two all-gathers; PyTorch says so on every call.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (FSDP2 shards)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: the --dp ranks as this many replicas of sharded copies "
                   "(must divide --dp; 1: FSDP over all --dp ranks)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2, help="Transformer blocks")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads (--tp must divide them)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="train DDP too and compare")
    p.add_argument("--eval-every", type=int, default=25,
                   help="steps between validation losses (0: none)")
    p.add_argument("--eval-batches", type=int, default=2,
                   help="fixed held-out batches each validation loss averages")
    p.add_argument("--peak-flops", type=float, help="GPU's dense bfloat16 peak, FLOP/s, for MFU "
                   "(default: looked up by the exact device name)")
    p.add_argument("--sample", type=int, default=200, help="bytes of text to sample at the end")
    p.add_argument("--suite", action="store_true", help="every layout against one process")
    p.add_argument("--checkpoint", default="build/13_gpt_dcp", help="--suite: DCP folder")
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


def run_suite(args, ctx, dtype, log):
    if ctx.world_size != 4:
        raise ValueError(f"--suite runs the 4-rank layouts: launch 4 ranks, not {ctx.world_size}")
    config = dict(d_model=16, n_heads=4, n_layers=2, seq_len=16)  # tiny: 7 layouts in seconds
    result = mesh_suite.suite(ctx, config, dtype, args.steps, args.seed, args.checkpoint, log)
    write_results(ctx, args.results, result, args=vars(args))


def check_run(args, ctx, lay):
    """ValueError, before anything is built, for flags that do not fit together."""
    lay.check_model(args.n_heads, args.d_model, args.seq_len)  # --tp must divide --n-heads
    if lay.world_size != ctx.world_size:
        raise ValueError(
            f"--pp {args.pp} x --dp {args.dp} x --tp {args.tp} = {lay.world_size} ranks, "
            f"but the job has {ctx.world_size}: make their product the world size"
        )
    global_batch = args.batch_size * args.dp
    if args.check and global_batch % ctx.world_size:
        raise ValueError(
            f"--check: DDP splits the global batch of {global_batch} sequences over "
            f"{ctx.world_size} ranks: make --batch-size * --dp a multiple of the world size"
        )
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: the warm-up steps cannot be negative")
    if args.eval_every < 0 or args.eval_batches < 1:
        raise ValueError("--eval-every must be 0 (no validation) or more, --eval-batches 1 or more")


def run_training(args, ctx, log):
    config = dict(d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
                  seq_len=args.seq_len)
    data = "hsdp" if args.replicate > 1 else "fsdp"  # NEW: --replicate R makes it HSDP
    lay = ml.Layout("run", dp=args.dp, tp=args.tp, pp=args.pp, data=data,
                    replicate=args.replicate, sequence_parallel=args.sp)
    check_run(args, ctx, lay)
    global_batch = args.batch_size * args.dp
    # NEW: bfloat16 is mixed precision: float32 master weights, bfloat16 compute.
    mixed = args.dtype == "bfloat16"
    dtype, compute = (torch.float32, torch.bfloat16) if mixed else (DTYPES[args.dtype], None)
    batches = runs.global_batches(args.steps, global_batch, args.seq_len, args.seed, ctx.device)
    # NEW: fixed batches of the held-out text, the same at every evaluation and on every rank.
    held_out = runs.global_batches(args.eval_batches, global_batch, args.seq_len, args.seed,
                                   ctx.device, split="val")

    def validation():
        return {"every": args.eval_every, "batches": held_out} if args.eval_every else None

    def train(lay, model, val):
        clock = functools.partial(mesh_counts.synced_clock, ctx.device)
        return runs.train(lay, model, batches, ctx, runs.adamw, args.lr, compute, clock=clock,
                          val=val)

    model = runs.new_model(config, dtype, ctx.device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = flops.matmul_params(model)  # PaLM's N: not the embedding tables
    computed = set()  # the dtype the head computes in: bfloat16 under mixed precision
    model.head.register_forward_hook(lambda module, inputs, out: computed.add(str(out.dtype)))
    val = validation()
    losses, mm, _, step_seconds = train(lay, model, val)
    params = mm.full_parameters()
    speed = mesh_counts.speed(step_seconds, args.warmup, global_batch * args.seq_len)
    result = {"layout": {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "sp": lay.sequence_parallel,
                         "data": lay.data, "mesh": dict(zip(ml.MESH_DIMS, lay.shape))},
              "config": config, "dtype": args.dtype, "master_dtypes": runs.master_dtypes(mm.module),
              "head_output_dtypes": sorted(computed), "losses": losses, "params": n_params,
              "warmup_steps": args.warmup, "timed_steps": speed.pop("timed_steps"),
              "step_seconds": step_seconds, "seconds": speed.pop("seconds")}
    if val is not None:
        result["val_steps"] = val["steps"]
        result["val_losses"] = runs.same_on_every_rank(ctx, val["losses"], "validation losses")
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
    result["gpu"] = gpu
    result |= speed
    if "tokens_per_s_skipped" in speed:
        log.info(f"tokens/s skipped: {speed['tokens_per_s_skipped']}")
    per_token = flops.flops_per_token(n_matmul, args.n_layers, args.d_model, args.seq_len)
    result |= mesh_counts.mfu_fields(result["tokens_per_s"], ctx.world_size, gpu, args.dtype,
                                     args.peak_flops, per_token)
    if "mfu" in result:
        log.info(f"MFU {result['mfu']:.2%} of the {gpu}'s dense bfloat16 peak, "
                 f"{result['peak_flops']:.4g} FLOP/s")
    else:
        log.info(result["mfu_skipped"])
    if args.check:  # NEW: the same weights and batches with DDP over every rank
        ddp = ml.Layout("ddp", dp=ctx.world_size, data="ddp")
        ddp_val = validation()
        result["ddp_losses"], ddp_mm, *_ = train(
            ddp, runs.new_model(config, dtype, ctx.device, args.seed), ddp_val
        )
        result["param_gap"] = runs.max_gap(params, ddp_mm.full_parameters())
        if ddp_val is not None:
            result["ddp_val_losses"] = runs.same_on_every_rank(
                ctx, ddp_val["losses"], "DDP's validation losses"
            )
    if lay.pp == 1 and args.sample:
        result["sample"] = runs.sample(params, config, dtype, ctx.device, args.sample, args.seed)
    elif args.sample:
        result["sample_skipped"] = "with --pp > 1 each rank holds only its stage's blocks"
        log.info(f"sampling skipped: {result['sample_skipped']}")
    rate = "" if result["tokens_per_s"] is None else f", {result['tokens_per_s']:,.0f} tokens/s"
    held = "" if val is None else f", validation loss {val['losses'][-1]:.3f}"
    log.info(f"{lay.pp}x{lay.dp}x{lay.tp} (pp x dp x tp, {lay.data}): loss {losses[0]:.3f} -> "
             f"{losses[-1]:.3f} in {args.steps} steps{held}{rate}")
    write_results(ctx, args.results, result, args=vars(args))


def main():
    args = parse_args()
    no_tf32()  # the equivalence checks compare float32 sums, not TF32 ones
    with distributed(group_of_one=True) as ctx:  # one plain process still has a mesh
        log = get_logger(ctx)
        if args.suite:
            run_suite(args, ctx, DTYPES[args.dtype], log)
        else:
            run_training(args, ctx, log)


if __name__ == "__main__":
    main()
