"""ZeRO stages 1, 2 and 3 from scratch against DDP: parameters, bytes held and sent per rank.

Run from the repository root:
    python scripts/09_zero.py
    torchrun --nproc_per_node=2 scripts/09_zero.py --stage 0 1 2 3
    torchrun --nproc_per_node=2 scripts/09_zero.py --optimizer sgd --lr 0.1
    torchrun --nproc_per_node=4 scripts/09_zero.py --sweep    # groups of 1, 2, 3 and 4 ranks
    torchrun --nproc_per_node=2 scripts/09_zero.py --optimizer adam sgd   # both, one job

Stage 0 is torch's DDP. Every rank trains the same MLP with Adam (or SGD
without momentum, --optimizer sgd) on its slice of the same batches (synthetic,
MNIST-shaped), once with torch's DDP and once per stage with
ddp_course.sharding.ZeRO, from the same start; the stage's full parameters
must equal DDP's (assert_close). After the last step each rank counts the bytes of
parameters, gradients and optimizer state it holds (held_bytes), next to the
ZeRO paper's formula (state_bytes_per_rank), and rank 0 the bytes its
collectives moved in that step twice: as DDP's comm hook and ZeRO's log count
them, and as torch's dispatcher saw them (CollectiveBytes). Stage 3 also
reports the most bytes of full parameters gathered at once. With --sweep the
job repeats all of it on sub-groups of its first 1, 2, ..., N ranks; with
several --optimizer, all of it for each optimizer. Rank 0 writes --results.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.data import synthetic_classification
from ddp_course.models import MLP
from ddp_course.runtime import distributed, get_logger, no_tf32, pick_backend, pick_device
from ddp_course.sharding import FP32_ADAM, FP32_SGD, ZeRO, state_bytes_per_rank
from ddp_course.tools.records import write_results
from ddp_course.tools.zero_counts import CollectiveBytes, held_bytes

# SGD without momentum steps by lr x gradient, so a gradient off by a factor shows in
# the parameters; Adam divides by the gradient's own size and hides it.
OPTIMIZERS = {"adam": (torch.optim.Adam, FP32_ADAM), "sgd": (torch.optim.SGD, FP32_SGD)}
DEFAULT_LR = {"adam": 1e-3, "sgd": 0.1}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4),
                   help="stages to run; 0 is torch's DDP")
    p.add_argument("--optimizer", nargs="+", choices=sorted(OPTIMIZERS), default=["adam"],
                   help="sgd: plain SGD (no momentum), where a gradient's scale shows; "
                        "several: each in turn")
    p.add_argument("--steps", type=int, default=3,
                   help="steps per stage; the last one's traffic is reported")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP's hidden layers")
    p.add_argument("--lr", type=float, help="learning rate (default: 1e-3 adam, 0.1 sgd)")
    p.add_argument("--sweep", action="store_true", help="also on groups of 1 .. N-1 ranks")
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


def make_model(args, rank, ctx):
    # Every rank starts elsewhere on purpose: DDP and ZeRO broadcast rank 0's weights.
    torch.manual_seed(rank)
    return MLP(hidden=args.hidden).to(ctx.device)


def global_batches(args, images, labels, world_size):
    n = world_size * args.batch_size
    return [(images[i * n : (i + 1) * n], labels[i * n : (i + 1) * n]) for i in range(args.steps)]


def my_slice(x, rank, b):
    return x[rank * b : (rank + 1) * b]


def train_ddp(args, batches, rank, group, ctx):
    """torch's DDP; returns the model, its optimizer, the last step's bytes as the hook
    counted them and what torch's dispatcher saw (CollectiveBytes)."""
    sent = []

    def counting_hook(state, bucket):
        # An all-reduce of b bytes is a reduce-scatter plus an all-gather: 2b (ZeRO, sec. 7).
        sent[-1] += 2 * bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    ddp = DDP(make_model(args, rank, ctx), process_group=group, gradient_as_bucket_view=True)
    ddp.register_comm_hook(group, counting_hook)
    opt = OPTIMIZERS[args.optimizer][0](ddp.parameters(), lr=args.lr)
    for x, y in batches:
        sent.append(0)
        opt.zero_grad(set_to_none=False)  # keep the gradients in DDP's buckets
        b = args.batch_size
        # Forward too: DDP's second forward broadcasts its rebuilt bucket order (once).
        with CollectiveBytes() as seen:
            F.cross_entropy(ddp(my_slice(x, rank, b)), my_slice(y, rank, b)).backward()
            opt.step()
    return ddp.module, opt, sent[-1], seen


def train_zero(args, stage, batches, rank, group, ctx):
    """ZeRO at ``stage``; returns it (gradients of the last step still held) and what
    torch's dispatcher saw in the last step."""
    optimizer_class = OPTIMIZERS[args.optimizer][0]
    zero = ZeRO(make_model(args, rank, ctx), optimizer_class, stage, group=group, lr=args.lr)
    for x, y in batches:
        zero.zero_grad()
        zero.comm.clear()  # the log then holds the last step only
        b = args.batch_size
        with CollectiveBytes() as seen:
            F.cross_entropy(zero(my_slice(x, rank, b)), my_slice(y, rank, b)).backward()
            zero.step()
    return zero, seen


def run_group(args, stages, images, labels, ranks, ctx):
    """Every stage on the sub-group of ``ranks`` (global ranks 0..n-1); rank 0 gets the rows."""
    group = dist.new_group(ranks)  # every rank of the job must call new_group
    if dist.get_rank() not in ranks:
        return []
    n, rank = len(ranks), dist.get_rank(group)
    batches = [(x.to(ctx.device), y.to(ctx.device))
               for x, y in global_batches(args, images, labels, n)]
    ddp_model, ddp_opt, ddp_sent, ddp_seen = train_ddp(args, batches, rank, group, ctx)
    reference = {k: p.detach() for k, p in ddp_model.named_parameters()}
    # How far training moved the parameters from rank 0's start (what DDP broadcast):
    # a gap to DDP far below it means the stages step like DDP, not merely that little moved.
    start = dict(make_model(args, 0, ctx).named_parameters())
    moved = max((reference[k] - start[k]).abs().max().item() for k in reference)
    num_params = sum(p.numel() for p in reference.values())
    rows = []
    for stage in stages:
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        peak_gathered, logged = None, []
        if stage == 0:  # DDP itself: the reference
            held, sent, gap, seen = held_bytes(ddp_model, ddp_opt), ddp_sent, 0.0, ddp_seen
        else:
            zero, seen = train_zero(args, stage, batches, rank, group, ctx)
            held, sent, logged = held_bytes(zero), zero.comm.volume_bytes, list(zero.comm.calls)
            if stage == 3:
                peak_gathered = zero.peak_gathered_bytes
            full = zero.full_parameters()
            torch.testing.assert_close(full, reference)  # the claim: ZeRO trains like DDP
            gap = max((full[k] - reference[k]).abs().max().item() for k in reference)
        cuda_peak = (torch.cuda.max_memory_allocated(ctx.device)
                     if ctx.device.type == "cuda" else None)
        per_rank = [None] * n
        dist.all_gather_object(per_rank, {"held": held.__dict__, "cuda_peak_bytes": cuda_peak},
                               group=group)
        formula = state_bytes_per_rank(stage, num_params, n, OPTIMIZERS[args.optimizer][1])
        rows.append({"optimizer": args.optimizer, "lr": args.lr,
                     "stage": stage, "world_size": n, "num_params": num_params,
                     "param_tensors": len(reference), "gap": gap, "moved": moved,
                     "per_rank": per_rank,
                     "formula": formula.__dict__, "sent_bytes": sent,
                     "ddp_sent_bytes": ddp_sent, "logged_calls": logged,
                     "torch_calls": seen.calls, "peak_gathered_bytes": peak_gathered})
    return rows


def main():
    args = parse_args()
    # One plain process on a GPU gets an nccl group of one, as torchrun's ranks would:
    # the collectives run on the device's tensors.
    with distributed(backend=pick_backend(pick_device()), group_of_one=True) as ctx:
        no_tf32()  # DDP and ZeRO compared to float32 rounding, also on a GPU
        log = get_logger(ctx)
        count = args.steps * ctx.world_size * args.batch_size
        images, labels = synthetic_classification(count).tensors
        sizes = range(1, ctx.world_size + 1) if args.sweep else [ctx.world_size]
        rows = []
        for optimizer in args.optimizer:
            lr = DEFAULT_LR[optimizer] if args.lr is None else args.lr
            one = argparse.Namespace(**{**vars(args), "optimizer": optimizer, "lr": lr})
            for n in sizes:
                rows += run_group(one, args.stage, images, labels, list(range(n)), ctx)
        for r in rows:
            held = r["per_rank"][0]["held"]
            log.info(f"{r['optimizer']} N={r['world_size']} stage {r['stage']}: "
                     f"|param - DDP| {r['gap']:.1e}; "
                     f"rank 0 holds {sum(held.values()) / 1e6:.3f} MB "
                     f"(formula {sum(r['formula'].values()) / 1e6:.3f}), "
                     f"{r['sent_bytes'] / 1e6:.3f} MB into collectives in a step")
        write_results(ctx, args.results, {"world_size": ctx.world_size,
                                          "device": ctx.device.type, "steps": args.steps,
                                          "optimizers": args.optimizer, "rows": rows})


if __name__ == "__main__":
    main()
