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
import logging
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from ddp_course import mesh_layouts as ml
from ddp_course import mesh_predictions as predict
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.mesh_model import MeshModel, token_mean_loss
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.runtime import distributed, get_logger, no_tf32
from ddp_course.tools import flops
from ddp_course.tools.mesh_counts import count_step, tensor_bytes
from ddp_course.tools.records import write_results

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# FSDP2 warns that the root returns a view (we never change the logits in place).
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")  # --suite reruns
# Gathering FSDP x TP parameters whole takes two all-gathers; PyTorch says so on every call.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
SUITE_LR = 0.5  # SGD: large enough that 5 steps move every weight, so equality means something


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (FSDP2 shards)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: the --dp ranks as this many replicas of sharded copies "
                   "(must divide --dp; 1: FSDP over all --dp ranks)")  # fmt: skip
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
                   help="steps between validation losses (0: none)")  # fmt: skip
    p.add_argument("--eval-batches", type=int, default=2,
                   help="fixed held-out batches each validation loss averages")  # fmt: skip
    p.add_argument("--peak-flops", type=float, help="GPU's dense bfloat16 peak, FLOP/s, for MFU "
                   "(default: looked up by the exact device name)")  # fmt: skip
    p.add_argument("--sample", type=int, default=200, help="bytes of text to sample at the end")
    p.add_argument("--suite", action="store_true", help="every layout against one process")
    p.add_argument("--checkpoint", default="build/13_gpt_dcp", help="--suite: DCP folder")
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


def new_model(config, dtype, device, seed):
    torch.manual_seed(seed)  # the same weights on every rank and in every layout
    return TinyGPT(**config).to(device=device, dtype=dtype)


def global_batches(steps, global_batch, seq_len, seed, device, split="train"):
    gen = torch.Generator().manual_seed(seed + 1)  # the same global batches on every rank
    text = shakespeare_bytes(split)
    return [[t.to(device) for t in lm_batch(text, global_batch, seq_len, gen)]
            for _ in range(steps)]  # fmt: skip


def my_slice(batch, mesh, dp):
    """This rank's sequences of the global batch: its data-parallel index picks them."""
    r, per = ml.data_rank(mesh), batch[0].shape[0] // dp
    return [t[r * per : (r + 1) * per] for t in batch]


def synced_clock(device):
    """Seconds now, once the device has done its queued work (a GPU runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train(lay, model, batches, ctx, optimizer, lr, compute_dtype=None, counts=None, val=None):
    """Train ``model`` laid out as ``lay``: the loss of every step, the MeshModel, the
    optimizer and the seconds of every step (the set-up before the first is not timed).
    With a ``counts`` dict, the second step (the steady one) runs with its collectives
    counted per phase and mesh dimension, into ``counts``. With ``val`` (a dict with
    ``every`` and ``batches``), the validation loss (the mean over those fixed batches)
    before the first step, after every ``every`` steps and after the last, untimed, goes
    into ``val["steps"]`` (steps done) and ``val["losses"]``."""
    mesh = ml.build_mesh(lay, ctx.device.type)
    mm = MeshModel(model, lay, mesh, compute_dtype=compute_dtype)  # NEW: a layout, one line
    opt = optimizer(mm.module.parameters(), lr)

    def validate(done):
        if val is not None and (done % val["every"] == 0 or done == len(batches)):
            held_out = [mm.evaluate(*my_slice(b, mesh, lay.dp)) for b in val["batches"]]
            val.setdefault("steps", []).append(done)
            val.setdefault("losses", []).append(statistics.fmean(held_out))
        return synced_clock(ctx.device)  # the next step's clock starts after it

    losses, seconds = [], []
    before = validate(0)
    for step, batch in enumerate(batches):
        if counts is not None and step == 1:
            loss, seen = count_step(mm, *my_slice(batch, mesh, lay.dp))
            counts.update(seen)
            losses.append(loss)
        else:
            losses.append(mm.forward_backward(*my_slice(batch, mesh, lay.dp)))
        opt.step()
        opt.zero_grad()
        after = synced_clock(ctx.device)
        seconds.append(after - before)
        before = validate(step + 1) if val is not None else after
    return losses, mm, opt, seconds


def sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr)


def one_process(model, batches, lr):
    """The reference: the whole global batch in one process; its weights and losses."""
    opt = sgd(model.parameters(), lr)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def max_gap(params, reference):
    """Largest |params - reference| over the parameters named in ``params`` (a stage's)."""
    return max((params[n] - reference[n]).abs().max().item() for n in params)


def memory_row(lay, mm, ctx, config, dtype, batch, lr):
    """Bytes this rank holds after one AdamW step, measured and from the formula."""
    opt = adamw(mm.module.parameters(), lr)
    mm.forward_backward(*my_slice(batch, mm.mesh, lay.dp))
    opt.step()
    params = list(mm.module.parameters())
    states = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    held = {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
            "optimizer": tensor_bytes(states)}  # fmt: skip
    whole = new_model(config, dtype, ctx.device, 0)  # the unsplit shapes, for the formula
    formula = predict.expected_memory_bytes(whole, lay, dtype.itemsize, mm.stage_index)
    return {"layout": lay.name, "rank": ctx.rank, "held": held, "formula": formula}


def count_kept_gathered(ctx, config, dtype, batch):
    """Collectives of one steady FSDP x TP step with ``reshard_after_forward=False``: the
    blocks keep their gathered parameters for backward (fewer all-gathers, more memory)."""
    lay = ml.layout("fsdp x tp", ctx.world_size)
    mesh = ml.build_mesh(lay, ctx.device.type)
    mm = MeshModel(new_model(config, dtype, ctx.device, 0), lay, mesh,
                   reshard_after_forward=False)  # fmt: skip
    for _ in range(2):  # the second step is the steady one
        _, seen = count_step(mm, *my_slice(batch, mesh, lay.dp))
        mm.module.zero_grad()
    return {"measured": seen,
            "formula": predict.expected_collectives(lay, config["n_layers"], False)}  # fmt: skip


def checkpoint_round_trip(ctx, config, dtype, batches, lr, folder):
    """Save on the 2 x 2 mesh (FSDP x TP), reload on 4 x 1 (FSDP) and in one process;
    each takes the next step; the losses and parameters after it are compared."""
    *before, after = batches
    _, mm, opt, _ = train(ml.layout("fsdp x tp", ctx.world_size),
                       new_model(config, dtype, ctx.device, 0), before, ctx, sgd, lr)  # fmt: skip
    model_sd, optim_sd = get_state_dict(mm.module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    results = {}
    saved_loss = mm.forward_backward(*my_slice(after, mm.mesh, 2))
    opt.step()
    saved_params = mm.full_parameters()
    results["2x2 (saved)"] = {"loss": saved_loss, "gap": 0.0}

    lay = ml.layout("fsdp", ctx.world_size)
    mesh = ml.build_mesh(lay, ctx.device.type)
    mm4 = MeshModel(new_model(config, dtype, ctx.device, 99), lay, mesh)  # other weights
    opt4 = sgd(mm4.module.parameters(), lr)
    model_sd, optim_sd = get_state_dict(mm4.module, opt4)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    set_state_dict(mm4.module, opt4, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loss4 = mm4.forward_backward(*my_slice(after, mesh, 4))
    opt4.step()
    results["4x1"] = {"loss": loss4, "gap": max_gap(mm4.full_parameters(), saved_params)}

    alone = new_model(config, dtype, ctx.device, 99)
    opt1 = sgd(alone.parameters(), lr)
    model_sd, optim_sd = get_state_dict(alone, opt1)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder, no_dist=True)
    set_state_dict(alone, opt1, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loss1 = lm_loss(alone(after[0]), after[1])
    loss1.backward()
    opt1.step()
    params1 = {n: p.detach() for n, p in alone.named_parameters()}
    results["one process"] = {"loss": loss1.item(), "gap": max_gap(params1, saved_params)}
    return results


def padded_batch(batch, seed):
    """The batch with each sequence cut to a random length: targets past it are -100."""
    gen = torch.Generator().manual_seed(seed)
    x, y = batch
    lengths = torch.randint(2, x.shape[1] + 1, (x.shape[0],), generator=gen).to(x.device)
    y = y.masked_fill(torch.arange(x.shape[1], device=x.device) >= lengths[:, None], -100)
    return x, y


def loss_normalisation_lab(ctx, config, dtype, batch):
    """Gradients of DDP with per-rank mean losses and with the global token count,
    against one process on the whole padded batch."""
    x, y = padded_batch(batch, 7)
    alone = new_model(config, dtype, ctx.device, 0)
    # One process: cross_entropy's own mean over the tokens whose target is not -100.
    functional.cross_entropy(alone(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
    reference = {n: p.grad for n, p in alone.named_parameters()}
    per = x.shape[0] // ctx.world_size
    mine = slice(ctx.rank * per, (ctx.rank + 1) * per)
    counts = [(y[r * per : (r + 1) * per] != -100).sum().item() for r in range(ctx.world_size)]
    gaps = {}
    group = dist.group.WORLD  # here DDP's data-parallel group spans every rank
    for way in ("mean of rank means", "global token count"):
        model = DistributedDataParallel(
            new_model(config, dtype, ctx.device, 0), process_group=group
        )
        logits = model(x[mine])
        if way == "mean of rank means":
            loss = functional.cross_entropy(logits.flatten(0, 1), y[mine].flatten())
        else:
            loss = token_mean_loss(logits, y[mine], group)
        loss.backward()
        gaps[way] = max((p.grad - reference[n]).abs().max().item()
                        for n, p in model.module.named_parameters())  # fmt: skip
    return {"tokens_per_rank": counts, "grad_gap": gaps}


def suite(args, ctx, config, dtype, log):
    batch_size = 8  # global sequences: divisible by every layout's dp
    batches = global_batches(args.steps + 1, batch_size, config["seq_len"], args.seed, ctx.device)
    train_batches = batches[: args.steps]
    start = {
        n: p.detach().clone() for n, p in new_model(config, dtype, ctx.device, 0).named_parameters()
    }
    model = new_model(config, dtype, ctx.device, 0)
    reference, reference_losses = one_process(model, train_batches, SUITE_LR)
    rows, memory, counts = [], [], {}
    for name in ml.LAYOUTS:
        lay = ml.layout(name, ctx.world_size)
        model = new_model(config, dtype, ctx.device, 0)
        seen = {}
        losses, mm, *_ = train(lay, model, train_batches, ctx, sgd, SUITE_LR, counts=seen)
        formula = predict.expected_collectives(lay, config["n_layers"])
        counts[name] = {"measured": seen, "formula": formula}
        params = mm.full_parameters()
        rows.append({"layout": name, "pp": lay.pp, "dp": lay.dp, "tp": lay.tp,
                     "losses": losses, "gap": max_gap(params, reference),
                     "names": sorted(params), "moved": max_gap(params, start)})  # fmt: skip
        memory.append(memory_row(lay, mm, ctx, config, dtype, batches[-1], SUITE_LR))
        log.info(f"{name:>10}: |params - one process| <= {rows[-1]['gap']:.1e}")
    return {
        "rows": rows, "memory": memory, "reference_losses": reference_losses,
        "all_names": sorted(reference),
        "counts": counts,
        "counts_kept_gathered": count_kept_gathered(ctx, config, dtype, batches[0]),
        "checkpoint": checkpoint_round_trip(ctx, config, dtype, batches, SUITE_LR, args.checkpoint),
        "loss_lab": loss_normalisation_lab(ctx, config, dtype, batches[0]),
    }  # fmt: skip


def gather_lists(ctx, value):
    """Every rank's ``value`` (a picklable object), in rank order, on every rank."""
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def run_suite(args, ctx, dtype, log):
    if ctx.world_size != 4:
        raise ValueError(f"--suite runs the 4-rank layouts: launch 4 ranks, not {ctx.world_size}")
    config = dict(d_model=16, n_heads=4, n_layers=2, seq_len=16)  # tiny: 7 layouts in seconds
    result = suite(args, ctx, config, dtype, log)
    result["memory"] = sum(gather_lists(ctx, result["memory"]), [])
    result["gaps_by_rank"] = gather_lists(ctx, {r["layout"]: r["gap"] for r in result["rows"]})
    result["names_by_rank"] = gather_lists(ctx, {r["layout"]: r["names"] for r in result["rows"]})
    result["counts_by_rank"] = gather_lists(
        ctx, {name: c["measured"] for name, c in result["counts"].items()}
    )
    result["config"] = config
    write_results(ctx, args.results, result, args=vars(args))


def same_on_every_rank(ctx, values, what):
    """``values`` (floats) if every rank holds the very same ones; RuntimeError otherwise."""
    seen = gather_lists(ctx, values)
    if any(v != seen[0] for v in seen):
        raise RuntimeError(f"{what} differ across the ranks: {seen}")
    return values


def master_dtypes(module):
    """The dtypes of the parameters the optimizer updates, by name (a DTensor's is its shard's)."""
    return sorted({str(p.dtype) for p in module.parameters()})


def sample(params, config, dtype, ctx, new_bytes, seed):
    """Text from the trained weights, gathered whole, on one process: a prompt and new bytes."""
    whole = TinyGPT(**config).to(device=ctx.device, dtype=dtype)
    whole.load_state_dict(params)
    prompt = torch.tensor([list(b"ROMEO:")], device=ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    text = whole.generate(prompt, new_bytes, temperature=0.8, generator=gen)
    return bytes(text[0].tolist()).decode("ascii", errors="replace")


def run_training(args, ctx, log):
    config = dict(d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
                  seq_len=args.seq_len)  # fmt: skip
    data = "hsdp" if args.replicate > 1 else "fsdp"  # NEW: --replicate R makes it HSDP
    lay = ml.Layout("run", dp=args.dp, tp=args.tp, pp=args.pp, data=data,
                    replicate=args.replicate, sequence_parallel=args.sp)  # fmt: skip
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
    # NEW: bfloat16 is mixed precision: float32 master weights, bfloat16 compute.
    mixed = args.dtype == "bfloat16"
    dtype, compute = (torch.float32, torch.bfloat16) if mixed else (DTYPES[args.dtype], None)
    batches = global_batches(args.steps, global_batch, args.seq_len, args.seed, ctx.device)
    # NEW: fixed batches of the held-out text, the same at every evaluation and on every rank.
    held_out = global_batches(args.eval_batches, global_batch, args.seq_len, args.seed,
                              ctx.device, split="val")  # fmt: skip

    def validation():
        return {"every": args.eval_every, "batches": held_out} if args.eval_every else None

    model = new_model(config, dtype, ctx.device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = flops.matmul_params(model)  # PaLM's N: not the embedding tables
    computed = set()  # the dtype the head computes in: bfloat16 under mixed precision
    model.head.register_forward_hook(lambda module, inputs, out: computed.add(str(out.dtype)))
    val = validation()
    losses, mm, _, step_seconds = train(lay, model, batches, ctx, adamw, args.lr, compute,
                                        val=val)  # fmt: skip
    params = mm.full_parameters()
    timed = step_seconds[args.warmup :]  # the first steps build communicators and caches
    seconds = sum(timed) if timed else None
    result = {"layout": {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "sp": lay.sequence_parallel,
                         "data": lay.data, "mesh": dict(zip(ml.MESH_DIMS, lay.shape))},
              "config": config, "dtype": args.dtype, "master_dtypes": master_dtypes(mm.module),
              "head_output_dtypes": sorted(computed), "losses": losses, "params": n_params,
              "warmup_steps": args.warmup, "timed_steps": len(timed),
              "step_seconds": step_seconds, "seconds": seconds}  # fmt: skip
    if val is not None:
        result["val_steps"] = val["steps"]
        result["val_losses"] = same_on_every_rank(ctx, val["losses"], "validation losses")
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
    result["gpu"] = gpu
    if seconds is None:
        result["tokens_per_s"] = None
        no_time = f"{args.steps} steps leave none after --warmup {args.warmup}"
        result["tokens_per_s_skipped"] = no_time
        log.info(f"tokens/s skipped: {no_time}")
    else:
        result["tokens_per_s"] = len(timed) * global_batch * args.seq_len / seconds
        result["median_step_s"] = statistics.median(timed)
    peak = args.peak_flops or (flops.peak_bf16_flops(gpu) if gpu else None)
    why = flops.skip_reason(gpu, args.dtype, args.peak_flops)
    if why is None and result["tokens_per_s"] is None:
        why = "MFU skipped: no step was timed"
    if why is None:
        per_token = flops.flops_per_token(n_matmul, args.n_layers, args.d_model, args.seq_len)
        per_gpu = result["tokens_per_s"] / ctx.world_size  # each GPU's share of the tokens
        result["mfu"] = flops.mfu(per_token, per_gpu, peak)
        result["flops_per_token"], result["peak_flops"] = per_token, peak
        log.info(f"MFU {result['mfu']:.2%} of the {gpu}'s dense bfloat16 peak, {peak:.4g} FLOP/s")
    else:
        result["mfu_skipped"] = why
        log.info(why)
    if args.check:  # NEW: the same weights and batches with DDP over every rank
        ddp = ml.Layout("ddp", dp=ctx.world_size, data="ddp")
        model = new_model(config, dtype, ctx.device, args.seed)
        ddp_val = validation()
        result["ddp_losses"], ddp_mm, *_ = train(ddp, model, batches, ctx, adamw, args.lr,
                                                 compute, val=ddp_val)  # fmt: skip
        result["param_gap"] = max_gap(params, ddp_mm.full_parameters())
        if ddp_val is not None:
            result["ddp_val_losses"] = same_on_every_rank(
                ctx, ddp_val["losses"], "DDP's validation losses"
            )
    if lay.pp == 1 and args.sample:
        result["sample"] = sample(params, config, dtype, ctx, args.sample, args.seed)
    elif args.sample:
        result["sample_skipped"] = "with --pp > 1 each rank holds only its stage's blocks"
        log.info(f"sampling skipped: {result['sample_skipped']}")
    speed = "" if result["tokens_per_s"] is None else f", {result['tokens_per_s']:,.0f} tokens/s"
    held = "" if val is None else f", validation loss {val['losses'][-1]:.3f}"
    log.info(f"{lay.pp}x{lay.dp}x{lay.tp} (pp x dp x tp, {lay.data}): loss {losses[0]:.3f} -> "
             f"{losses[-1]:.3f} in {args.steps} steps{held}{speed}")  # fmt: skip
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
