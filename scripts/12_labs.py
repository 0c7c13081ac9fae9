"""Broken distributed scripts to diagnose, each with its fix (--fixed).

Run from the repository root:
    python scripts/12_labs.py --lab set_epoch divergent
    torchrun --nproc_per_node=2 scripts/12_labs.py --lab set_epoch divergent
    torchrun --nproc_per_node=2 scripts/12_labs.py --lab mismatch unused rank0_only --fixed
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc_per_node=2 scripts/12_labs.py --lab mismatch

Labs (several may run in one job, in the order given):
  mismatch     rank 0 all-reduces the loss, the other ranks broadcast it: on gloo a
               hang until --timeout-s (on nccl undefined: a hang until the watchdog's
               timeout, or wrong numbers), or an error naming both collectives with
               TORCH_DISTRIBUTED_DEBUG=DETAIL. Fix: the same collective everywhere.
  rank0_only   a barrier inside `if rank == 0` (after saving a checkpoint): rank 0
               waits for ranks that went on training. --monitored uses
               dist.monitored_barrier on a gloo group (it exists on gloo only), which
               names the ranks that did not arrive. Fix: the barrier outside the `if`.
  unused       a model whose second head forward never uses: DDP's "Expected to have
               finished reduction" error on the second step, naming the parameters
               with TORCH_DISTRIBUTED_DEBUG=INFO. Fix: find_unused_parameters=True.
  shapes       rank 1 builds a wider layer: DDP's construction check fails.
               Fix: the same model on every rank.
  set_epoch    DistributedSampler without set_epoch: every epoch in the same order
               (both variants run; nothing fails).
  divergent    each rank seeds its model with seed + rank, trained with a hand-written
               gradient all-reduce: the models never meet. DDP's broadcast at
               construction hides the bug (both variants run; nothing fails).

A collective that never matches ends after --timeout-s seconds (the process
group's timeout; torch's defaults are 30 min on gloo, 10 min on nccl): on gloo
it raises a RuntimeError in Python; on nccl the watchdog thread aborts the
process. With --flight-recorder DIR every rank's flight recorder (on by default,
TORCH_FR_BUFFER_SIZE entries) goes to DIR/rank_<rank>: written by the script when
a lab raises, and by nccl's watchdog itself (TORCH_FR_DUMP_TEMP_FILE) when it
aborts the process, where no `except` runs. Models and batches live on the
rank's device. Rank 0 writes --results after every lab, so the labs before a
failing one keep their findings.
"""

import datetime
import io
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ddp_course.ddp import average_gradients
from ddp_course.harness.script_args import script_parser
from ddp_course.models import MLP
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools import debug
from ddp_course.tools.records import write_results

LABS = ("mismatch", "rank0_only", "unused", "shapes", "set_epoch", "divergent")


def parse_args():
    p = script_parser(__doc__, timeout_s=5.0, results=None)
    p.add_argument("--lab", nargs="+", choices=LABS, required=True, help="labs to run, in order")
    p.add_argument("--fixed", action="store_true", help="run the fixed version")
    p.add_argument("--monitored", action="store_true", help="rank0_only: monitored_barrier")
    p.add_argument("--flight-recorder", metavar="DIR", help="dump the flight recorder here")
    return p.parse_args()


def on_device(model, ctx, **ddp_kwargs):
    """``model`` on this rank's device, wrapped in DDP (one GPU per rank on CUDA)."""
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(model.to(ctx.device), device_ids=ids, **ddp_kwargs)


def lab_mismatch(ctx, args, log):
    loss = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    if args.fixed or ctx.rank == 0:
        dist.all_reduce(loss)  # the sum of every rank's loss
    else:
        dist.broadcast(loss, src=0)  # BUG: another collective than rank 0's
    log.info(f"mismatch: summed loss {loss.item()}")
    return {"loss_sum": loss.item()}


def lab_rank0_only(ctx, args, log):
    grads = torch.ones(8, device=ctx.device)
    # monitored_barrier exists on gloo only: a gloo group beside the default one (on
    # nccl the only way to have it; on gloo a second group). Every rank creates it.
    monitor_group = dist.new_group(backend="gloo") if args.monitored else None
    for epoch in range(2):
        dist.all_reduce(grads)  # one training step's gradient all-reduce
        if ctx.rank == 0:
            torch.save({"grads": grads}, io.BytesIO())  # the checkpoint
            if args.monitored and not args.fixed:
                # Names the ranks that do not arrive; its timeout is shorter than
                # the others' collective timeout, so it speaks first.
                wait = datetime.timedelta(seconds=args.timeout_s / 2)
                dist.monitored_barrier(group=monitor_group, timeout=wait)
            elif not args.fixed:
                dist.barrier()  # BUG: only rank 0 gets here
        if args.fixed:
            dist.barrier()  # every rank waits until the checkpoint is written
        log.info(f"rank0_only: epoch {epoch} done")
    return {"epochs": 2}


class TwoHeads(nn.Module):
    """A body and two heads; forward uses only head_a, so head_b gets no gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 2)
        self.head_b = nn.Linear(16, 2)

    def forward(self, x):
        return self.head_a(torch.relu(self.body(x)))


def lab_unused(ctx, args, log):
    torch.manual_seed(0)
    model = on_device(TwoHeads(), ctx, find_unused_parameters=args.fixed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # the error comes at the second forward
        opt.zero_grad()
        model(torch.randn(4, 8).to(ctx.device)).sum().backward()
        opt.step()
    log.info("unused: 2 steps done")
    return {"steps": 2}


def lab_shapes(ctx, args, log):
    hidden = 16 if args.fixed else 16 + ctx.rank  # BUG: a width that depends on the rank
    model = MLP(in_features=8, hidden=hidden, depth=1).to(ctx.device)
    differ = debug.models_differ(model)  # the course's check, before DDP
    log.info(f"shapes: models_differ names {differ}")
    on_device(model, ctx)
    return {"differ": differ}


def lab_set_epoch(ctx, args, log):
    found = {}
    for variant in ("forgot set_epoch", "set_epoch"):
        sampler = DistributedSampler(range(32), ctx.world_size, ctx.rank, shuffle=True, seed=0)
        orders = []
        for epoch in range(3):
            if variant == "set_epoch":
                sampler.set_epoch(epoch)  # the fix: a different shuffle every epoch
            orders.append(list(sampler))
        found[variant] = {"orders": orders, "repeated": debug.repeated_orders(orders)}
        log.info(f"set_epoch: {variant}: epochs in the same order {found[variant]['repeated']}")
    return found


def _gap(model, ctx):
    # Largest difference between any rank's parameters and rank 0's.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, flat)
    return max((t - everyone[0]).abs().max().item() for t in everyone)


def _train_by_hand(model, ctx, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own data
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 2, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)).backward()
        average_gradients(model)  # every rank applies the same averaged gradient
        opt.step()


def lab_divergent(ctx, args, log):
    found = {}
    for variant, seed in (("seed + rank", ctx.rank), ("same seed", 0)):
        torch.manual_seed(seed)
        model = MLP(in_features=8, hidden=16, depth=1, num_classes=2).to(ctx.device)
        before = _gap(model, ctx)
        _train_by_hand(model, ctx)
        found[variant] = {"gap_before": before, "gap_after": _gap(model, ctx),
                          "differ": debug.models_differ(model)}
        log.info(f"divergent: {variant}: {found[variant]}")
    torch.manual_seed(ctx.rank)  # the bug again, now under DDP
    ddp = on_device(MLP(in_features=8, hidden=16, depth=1, num_classes=2), ctx)
    found["seed + rank, DDP"] = {"differ": debug.models_differ(ddp.module)}
    log.info(f"divergent: under DDP models_differ names {found['seed + rank, DDP']['differ']}")
    return found


def main():
    args = parse_args()
    if args.flight_recorder:
        # nccl's watchdog aborts the process on a timeout before any `except` runs;
        # asked to, it writes the recorder itself, to <TORCH_FR_DUMP_TEMP_FILE><rank>.
        folder = os.path.abspath(args.flight_recorder)
        os.makedirs(folder, exist_ok=True)
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(folder, "rank_"))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    with distributed(timeout_s=args.timeout_s, group_of_one=True) as ctx:
        log = get_logger(ctx)
        results = {"world_size": ctx.world_size, "fixed": args.fixed, "labs": {}}
        for name in args.lab:
            try:
                results["labs"][name] = globals()[f"lab_{name}"](ctx, args, log)
            except Exception:  # gloo: the timed-out collective raised here
                if args.flight_recorder:
                    debug.dump_flight_recorder(args.flight_recorder, ctx.rank)
                raise
            # After every lab, so a failing lab keeps the findings of those before it.
            write_results(ctx, args.results, results)


if __name__ == "__main__":
    main()
