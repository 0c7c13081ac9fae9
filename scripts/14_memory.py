"""The memory of one training step: activations per checkpointing policy, and FSDP2 in bf16.

Run from the repository root:
    python scripts/14_memory.py
    python scripts/14_memory.py --policy none every_block --seq-len 64 --batch-size 8
    torchrun --nproc_per_node=2 scripts/14_memory.py

Each rank builds the same TinyGPT (written-out attention, dropout on) and, for
each checkpointing policy, measures the bytes saved for backward with
saved-tensor hooks (ddp_course.tools.saved_tensors), predicts them from the
shapes (ddp_course.activation_memory), checks that the gradients equal those
without checkpointing bit for bit, counts the matmul FLOPs of forward and
backward (recomputation shows as extra FLOPs) and times the step (median, min
and max of --steps; printed, never asserted; torchrun sets OMP_NUM_THREADS=1,
so a rank computes on one thread where a plain process uses every core). The
policies are those of ddp_course.recompute_policies.apply_policy: whole
regions, op-level SAC (torchtitan's "op" mode), Korthikanti et al.'s selective
recomputation of the attention core, and every Linear on its own (the
anti-pattern: no byte saved).
On a GPU it also reads the bytes the CUDA allocator holds when forward returns
(the saved storages and the loss, each rounded up to 512 bytes) and its peak
for each policy, and checks the peak lies within the bound that
ddp_course.step_budget.peak_bound predicts (at least the activations and
the logits; at most everything the step may hold at once, with the allocator's
512-byte rounding); on a CPU that part is skipped and says so. With 2 or more
ranks it shards the model with FSDP2 under MixedPrecisionPolicy(
param_dtype=bfloat16, reduce_dtype=float32) and measures each state's bytes on
every rank against the formula: shards per parameter as torch.chunk splits its
first dimension (uneven when N does not divide it), the bf16 all-gather of a
block counted from the collective itself (padding included). It then trains
the model in float32 for 2 SGD steps under FSDP2 with activation checkpointing
placed each way recompute_policies.shard_with_checkpointing knows (none, per
block before or after sharding, around the whole model), counts the second
step's all-gathers and reduce-scatters (ddp_course.tools.collective_log) and
backward's FLOPs (a recomputation adds a forward), reads the full weights in
use at once in backward (tools.peak_memory.UnshardedPeak), and checks every
run's parameters against the run without checkpointing, and that one against
one process trained on every rank's batch. Rank 0 writes
--results.
"""

import contextlib
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.flop_counter import FlopCounterMode

from ddp_course import activation_memory as am
from ddp_course import recompute_policies, step_budget
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.harness.script_args import script_parser
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.peak_memory import UnshardedPeak
from ddp_course.tools.records import write_results
from ddp_course.tools.saved_tensors import SavedTensorCounter
from ddp_course.tools.zero_counts import storage_bytes


def parse_args():
    meaning = {
        "batch_size": "sequences per rank per step",
        "steps": "timed steps per policy (median)",
        "seed": "seeds the weights and dropout",
    }
    p = script_parser(__doc__, d_model=64, n_heads=4, n_layers=2, seq_len=32, batch_size=4,
                      steps=3, seed=0, results=None, help=meaning)
    p.add_argument("--dropout", type=float, default=0.1, help="dropout probability")
    policies = recompute_policies.POLICIES
    p.add_argument("--policy", nargs="+", choices=policies, default=list(policies),
                   help="checkpointing policies to measure")
    return p.parse_args()


def config(args):
    return {"d_model": args.d_model, "n_heads": args.n_heads, "n_layers": args.n_layers,
            "seq_len": args.seq_len, "dropout": args.dropout, "flash": False}


def step(model, x, y, seed):
    """Forward and backward; returns (saved-tensor counter, loss)."""
    torch.manual_seed(seed)  # the same dropout masks for every policy
    with SavedTensorCounter(model.parameters()) as saved:
        loss = lm_loss(model(x), y)
    loss.backward()
    return saved, loss


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_policy(args, policy, dev, x, y, reference):
    torch.manual_seed(args.seed)
    model = TinyGPT(**config(args)).to(dev)
    record = recompute_policies.apply_policy(model, policy)  # NEW: the policy wraps blocks in place
    with FlopCounterMode(display=False) as flops:
        saved, _ = step(model, x, y, args.seed)
    storages = sum(1 for *_, kind in saved.saved if kind == "activation")
    held = saved.activation_bytes + record.saved_bytes  # before the timed steps add theirs
    cached = len(record.saved_ops)  # outputs op-level SAC keeps, one step's
    grads = [p.grad for p in model.parameters()]
    equal = reference is None or all(torch.equal(a, b) for a, b in zip(grads, reference))
    # CUDA's fused dropout keeps a 1-byte mask; a CPU's keeps one in the input's dtype.
    mask_bytes = 1 if dev.type == "cuda" else None
    predicted = am.predict_activations(config(args), args.batch_size, args.seq_len, policy,
                                       mask_bytes=mask_bytes)
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        sync(dev)
        start = time.perf_counter()
        step(model, x, y, args.seed)
        sync(dev)
        times.append(time.perf_counter() - start)
    row = {"policy": policy, "measured_bytes": held,
           "predicted_bytes": predicted["held"], "recompute_bytes": predicted["recompute"],
           "flops": flops.get_total_flops(), "grads_equal_none": equal,
           "step_s": statistics.median(times), "step_s_min": min(times),
           "step_s_max": max(times), "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        # The allocator's peak above the weights: activations, gradients, logits and the
        # region recomputed in backward, with the temporaries and rounding of the bound.
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.manual_seed(args.seed)
        loss = lm_loss(model(x), y)
        # When forward returns the allocator holds the saved storages (what the hooks
        # counted, SAC's cached outputs included) and the loss, each rounded up to 512 bytes,
        # less the token ids and targets: saved, but allocated before `base` (measured on
        # an H200: 772 bytes under the prediction without this term).
        row["cuda_forward_bytes"] = torch.cuda.memory_allocated(dev) - base
        row["cuda_forward_tensors"] = storages + cached + 1
        row["cuda_forward_inputs_bytes"] = x.nbytes + y.nbytes
        loss.backward()
        del loss
        peak = torch.cuda.max_memory_allocated(dev) - base
        b, s, h, a = args.batch_size, args.seq_len, args.d_model, args.n_heads
        logits = 4 * b * s * model.head.out_features
        gradients = step_budget.state_bytes(model)["gradients"]
        # At most: saved storages, gradients, a kept input per checkpointed region, 8 more.
        tensors = storages + len(grads) + 2 * args.n_layers + 8
        bound = step_budget.peak_bound(
            activations=predicted["held"], recompute=predicted["recompute"],
            gradients=gradients, logits=logits,
            largest=4 * max(4 * s * b * h, a * s * s * b), tensors=tensors,
        )
        row["cuda_peak_bytes"] = peak
        # Not a point prediction of the peak: every gradient and the recomputed region on
        # top of every activation, which never coexist (the bound below is the check).
        row["cuda_predicted_bytes"] = (
            predicted["held"] + predicted["recompute"] + logits + gradients
        )
        row["cuda_low_bytes"], row["cuda_high_bytes"] = bound.low, bound.high
        row["cuda_peak_of_high"] = bound.check(peak)  # raises outside the bound
    return row, grads


def shard_numel(shape, rank, n):
    """Elements of a parameter on ``rank`` under FSDP2: ``torch.chunk`` of dim 0 in ``n``."""
    rows, chunk = shape[0], math.ceil(shape[0] / n)
    return max(0, min(chunk, rows - rank * chunk)) * math.prod(shape[1:])


def fsdp_mixed_precision(args, ctx):
    """Bytes of each state on this rank under FSDP2 with bf16 compute, and the formulas."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch.manual_seed(args.seed)
    model = TinyGPT(**(config(args) | {"dropout": 0.0})).to(ctx.device)
    n, r = ctx.world_size, ctx.rank
    n_params = sum(p.numel() for p in model.parameters())
    shapes = [p.shape for p in model.parameters()]
    local_params = sum(shard_numel(shape, r, n) for shape in shapes)
    # The all-gather's output pads each parameter's dim 0 to n equal chunks.
    block_padded = sum(math.ceil(p.shape[0] / n) * n * p[0].numel()
                       for p in model.blocks[0].parameters())
    # NEW: parameters stored sharded in float32, gathered in bfloat16 for compute,
    # gradients reduce-scattered in float32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    gathered = []

    def during_compute(module, inputs):  # inside a block's forward: its whole bf16 weights
        block = next(b for b in model.blocks if b.attn is module)
        gathered.append([(p.dtype, p.numel() * p.element_size()) for p in block.parameters()])

    for block in model.blocks:
        block.attn.register_forward_pre_hook(during_compute)
    x, y = lm_batch(shakespeare_bytes("train"), args.batch_size, args.seq_len,
                    torch.Generator().manual_seed(args.seed))
    comms = CollectiveLog()
    with comms.recording("forward"):  # all-gathers: the root's parameters, then each block's
        logits = model(x.to(ctx.device))
    lm_loss(logits.float(), y.to(ctx.device)).backward()
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()

    gathers = [c for c in comms.calls if c["op"] == "all_gather"]
    measured = {
        "sharded_parameters": storage_bytes(model.parameters(), per_tensor=True),
        "unsharded_bf16_block": gathers[1]["bytes"],  # block 0's, after the root's
        "gathered_dtypes": sorted({str(d) for g in gathered for d, _ in g}),
        "sharded_gradients": storage_bytes((p.grad for p in model.parameters()), per_tensor=True),
        "gradient_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "adamw_state": storage_bytes((v for s in optimizer.state.values() for v in s.values()),
                                     per_tensor=True),
    }
    tensors = len(list(model.parameters()))
    formula = {"sharded_parameters": 4 * local_params, "unsharded_bf16_block": 2 * block_padded,
               "sharded_gradients": 4 * local_params,
               "adamw_state": 8 * local_params + 4 * tensors}
    return {"rank": ctx.rank, "parameters": n_params, "measured": measured, "formula": formula}


# (order, reshard_after_forward): None is FSDP2's default, the blocks reshard after
# forward and the root keeps its weights for backward, which starts with them.
AC_RUNS = [("no_ac", None), ("ac_then_fsdp", None), ("fsdp_then_ac", None),
           ("ac_around_root", None), ("no_ac", False)]


def train_two_steps(model, run, x, y, comms=None):
    """Two SGD steps; with ``comms``, the second's collectives go to it under "forward"
    and "backward", and it returns the most bytes of full weights in use at once in that
    backward and its matmul FLOPs (a recomputed forward adds its own)."""
    # SGD: AdamW divides by the root of tiny second moments, which turns a rounding
    # difference of the sharded sums into a step of lr.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        measure = comms is not None and i == 1
        with comms.recording("forward") if measure else contextlib.nullcontext():
            out = run(x)
        if measure:
            with comms.recording("backward"), UnshardedPeak(model) as full:
                with FlopCounterMode(display=False) as flops:
                    lm_loss(out, y).backward()
        else:
            lm_loss(out, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (full.peak_bytes, flops.get_total_flops()) if comms is not None else None


def fsdp_checkpointing(args, ctx):
    """Collectives per step and full weights in backward, for each place of the checkpoints."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    cfg = config(args) | {"dropout": 0.0}
    batches = [lm_batch(shakespeare_bytes("train"), args.batch_size, args.seq_len,
                        torch.Generator().manual_seed(args.seed + 1 + k))
               for k in range(ctx.world_size)]
    # One process on every rank's batch: the mean loss equals the mean of the ranks' means.
    torch.manual_seed(args.seed)
    one = TinyGPT(**cfg).to(ctx.device)
    xs, ys = (torch.cat(t).to(ctx.device) for t in zip(*batches))
    train_two_steps(one, one, xs, ys)
    x, y = (t.to(ctx.device) for t in batches[ctx.rank])
    rows, no_ac = [], None
    for order, reshard in AC_RUNS:
        torch.manual_seed(args.seed)
        model = TinyGPT(**cfg).to(ctx.device)
        run = recompute_policies.shard_with_checkpointing(
            model, order, mesh=mesh, reshard_after_forward=reshard
        )  # NEW: AC and FSDP2
        comms = CollectiveLog()
        full, flops = train_two_steps(model, run, x, y, comms)
        params = [p.full_tensor() for p in model.parameters()]
        reference = no_ac or [p.detach() for p in one.parameters()]
        for a, b in zip(params, reference):
            torch.testing.assert_close(a, b)  # raises: checkpointing changed the training

        def count(phase, op, comms=comms):
            return sum(1 for c in comms.calls if c["phase"] == phase and c["op"] == op)

        backward = [c["op"] for c in comms.calls if c["phase"] == "backward"]
        rows.append({"order": order, "reshard_after_forward": reshard,
                     "forward_all_gathers": count("forward", "all_gather"),
                     "backward_all_gathers": count("backward", "all_gather"),
                     "reduce_scatters": count("backward", "reduce_scatter"),
                     "backward_order": " ".join({"all_gather": "AG", "reduce_scatter": "RS"}
                                                .get(op, op) for op in backward),
                     "full_weights_in_backward": full, "backward_flops": flops,
                     "max_gap": max((a - b).abs().max().item()
                                    for a, b in zip(params, reference)),
                     "compared_with": "one process" if no_ac is None else "no_ac"})
        no_ac = no_ac or params

    def nbytes(module):
        return storage_bytes(module.parameters())

    return {"rows": rows, "model_bytes": nbytes(one), "block_bytes": nbytes(one.blocks[0]),
            "root_bytes": nbytes(one) - sum(nbytes(b) for b in one.blocks)}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        dev = ctx.device
        x, y = lm_batch(shakespeare_bytes("train"), args.batch_size, args.seq_len,
                        torch.Generator().manual_seed(args.seed))
        x, y = x.to(dev), y.to(dev)
        rows, reference = [], None
        for policy in ["none"] + [p for p in args.policy if p != "none"]:
            row, grads = measure_policy(args, policy, dev, x, y, reference)
            reference = grads if policy == "none" else reference
            if policy in args.policy:
                rows.append(row)
            ms, equal = row["step_s"] * 1e3, row["grads_equal_none"]
            log.info(f"{policy:>17}: saved {row['measured_bytes']:>9,} B (predicted "
                     f"{row['predicted_bytes']:,}), {row['flops']:,} FLOPs, grads equal to "
                     f"none: {equal}, step {ms:.1f} ms on {row['threads']} thread(s)")
            if "cuda_peak_bytes" in row:
                log.info(f"{'':>17}  CUDA peak {row['cuda_peak_bytes']:,} B within "
                         f"[{row['cuda_low_bytes']:,}, {row['cuda_high_bytes']:,}] B, "
                         f"{row['cuda_peak_of_high']:.0%} of the high end")
        if dev.type != "cuda":
            log.info("skipped: the CUDA allocator's peak per policy needs a GPU")
        result = {"world_size": ctx.world_size, "device": str(dev), "config": config(args),
                  "batch_size": args.batch_size, "seq_len": args.seq_len}
        if ctx.world_size > 1:
            mine = fsdp_mixed_precision(args, ctx)
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, mine)
            result["fsdp"] = everyone
            m, f = mine["measured"], mine["formula"]
            log.info(f"FSDP2 bf16/fp32 on {ctx.world_size} ranks, rank 0 bytes: measured {m}, "
                     f"formula {f}")
            result["fsdp_ac"] = fsdp_checkpointing(args, ctx)
            for row in result["fsdp_ac"]["rows"]:
                log.info(f"FSDP2 {row['order']:>14} (reshard_after_forward="
                         f"{row['reshard_after_forward']}): all-gathers "
                         f"{row['forward_all_gathers']} in forward, "
                         f"{row['backward_all_gathers']} in backward, reduce-scatters "
                         f"{row['reduce_scatters']}; backward {row['backward_flops']:,} "
                         f"FLOPs, full weights in it at most "
                         f"{row['full_weights_in_backward']:,} B; parameters within "
                         f"{row['max_gap']:.1e} of {row['compared_with']}")
        else:
            log.info(
                "skipped: FSDP2 (mixed precision, checkpointing) needs 2 or more ranks (torchrun)"
            )
        write_results(ctx, args.results, result, rows=rows, args=vars(args))


if __name__ == "__main__":
    main()
