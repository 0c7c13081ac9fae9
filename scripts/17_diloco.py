"""DiLoCo from scratch checked against DDP, then DDP against DiLoCo at equal tokens.

Run from the repository root:
    python scripts/17_diloco.py
    torchrun --nproc_per_node=2 scripts/17_diloco.py
    torchrun --nproc_per_node=2 scripts/17_diloco.py --part train --sync-every 10 50 --steps 200

Part "check" (float64, a small TinyGPT, each rank its own batches): DiLoCo with
H = 1, an inner SGD and an outer SGD of learning rate 1 without momentum
against DDP with the same SGD, step by step; then DiLoCo with H = 2, inner
AdamW and outer Nesterov SGD: how far apart the ranks' parameters are after
each inner step (zero after every synchronisation, not between).

Part "train": every rank builds the same TinyGPT (same seed) and draws its own
batches of the Shakespeare bytes (seeded by rank). For each method it trains --steps inner
steps with AdamW, so every method sees the same tokens: DDP (gradients
all-reduced every step), and DiLoCo (ddp_course.local_sgd) for each
--sync-every H, with an outer SGD of learning rate --outer-lr, Nesterov
momentum 0.9 (Douillard et al. 2023). Each rank records its training loss per
step; every --eval-every steps (a multiple of every H, so DiLoCo's ranks agree
then) the validation loss on fixed held-out batches, and how far the ranks'
parameters are apart. The course's collective log counts every all-reduce, and
each step is timed (forward, backward, the inner step and any communication it
waits for; the slowest rank's time). Over a slow link (notebook 17 runs the
ranks as two nodes joined by a rate-limited veth) the time per step is where
DiLoCo pays off.

Part "streaming": Streaming DiLoCo (ddp_course.local_sgd.StreamingDiLoCo) at the
last --sync-every H with --fragments P, trained as part "train" trains each method:
one fragment synchronised every H/P inner steps, each every H.

Part "labs", DiLoCo at the first --sync-every H: as it should run, with the last
rank training on from its own parameters after each synchronisation (it forgot
to load the synchronised ones), and with an outer learning rate of
--lab-outer-lr.

Rank 0 writes --results.
"""

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.harness.script_args import script_parser
from ddp_course.local_sgd import DiLoCo, StreamingDiLoCo
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.debug import rank_spread
from ddp_course.tools.records import write_results


def parse_args():
    meaning = {"batch_size": "sequences per rank per step", "steps": "inner steps per method",
               "lr": "AdamW's learning rate (DDP's and DiLoCo's inner optimizer)"}
    p = script_parser(__doc__, d_model=64, n_heads=4, n_layers=2, seq_len=64, batch_size=8,
                      steps=100, lr=3e-3, seed=0, results=None, help=meaning)
    p.add_argument("--sync-every", type=int, nargs="+", default=[10, 50],
                   help="DiLoCo's H values, inner steps between synchronisations")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate")
    p.add_argument("--eval-every", type=int, default=50,
                   help="steps between validation losses; a multiple of every H")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    p.add_argument("--fragments", type=int, default=5,
                   help="Streaming DiLoCo's P, fragments synchronised in turn")
    p.add_argument("--part", nargs="+", choices=("check", "train", "streaming", "labs"),
                   default=["check", "train"], help="what to run")
    p.add_argument("--lab-outer-lr", type=float, default=3.0,
                   help="the labs' outer learning rate that is too large")
    args = p.parse_args()
    if any(args.eval_every % h for h in args.sync_every) or args.steps % args.eval_every:
        p.error("--eval-every must be a multiple of every --sync-every, and divide --steps")
    return args


def build(args, device):
    torch.manual_seed(args.seed)
    return TinyGPT(d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
                   seq_len=args.seq_len).to(device)


@torch.no_grad()
def validation_loss(model, batches):
    model.eval()
    loss = sum(lm_loss(model(x), y).item() for x, y in batches) / len(batches)
    model.train()
    return loss


class ForgetsToLoad(DiLoCo):
    """The lab's bug: after a synchronisation the last rank trains on from its own
    parameters instead of the synchronised ones (it stepped the outer optimizer, then
    put its local copy back)."""

    def sync(self):
        mine = [p.detach().clone() for p in self.params]
        super().sync()
        if dist.get_rank() == dist.get_world_size() - 1:
            with torch.no_grad():
                for p, m in zip(self.params, mine):
                    p.copy_(m)


def train(args, ctx, method, held_out, outer_lr=None, diloco=DiLoCo):
    """One method's run: losses per step, validation losses, rank spread, collectives.

    ``method`` is ``"ddp"``, ``"diloco H=<h>"`` or ``"streaming H=<h> P=<p>"``;
    ``outer_lr`` (default --outer-lr) and ``diloco`` (the class) change DiLoCo's run for
    the labs.
    """
    model = build(args, ctx.device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if method == "ddp":
        step_model, sync = DDP(model) if ctx.world_size > 1 else model, None
    else:
        step_model = model
        outer = torch.optim.SGD(model.parameters(), lr=outer_lr or args.outer_lr, momentum=0.9,
                                nesterov=True)
        h, *p = (int(word.split("=")[1]) for word in method.split()[1:])
        sync = (StreamingDiLoCo(model, inner, outer, h, p[0]) if p
                else diloco(model, inner, outer, sync_every=h))
    tokens = shakespeare_bytes("train")
    gen = torch.Generator().manual_seed(args.seed + 1 + ctx.rank)
    log = CollectiveLog()
    losses, evals, seconds = [], [], []
    with sync or contextlib.nullcontext():
        for step in range(1, args.steps + 1):
            x, y = (t.to(ctx.device) for t in lm_batch(tokens, args.batch_size,
                                                          args.seq_len, gen))
            start = time.perf_counter()
            with log.recording("train"):
                loss = lm_loss(step_model(x), y)
                loss.backward()
                inner.step()
            inner.zero_grad()
            losses.append(loss.item())  # waits for the device: the step is done
            seconds.append(time.perf_counter() - start)
            if step % args.eval_every == 0:
                evals.append({"step": step, "val_loss": validation_loss(model, held_out),
                              "rank_spread": rank_spread(parameters_to_vector(model.parameters()))})
    calls = [c for c in log.calls if c["op"] == "all_reduce"]
    slowest = torch.tensor(seconds, dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return {"losses": losses, "evals": evals, "step_s": slowest.tolist(),
            "median_step_s": statistics.median(slowest.tolist()), "all_reduces": len(calls),
            "bytes": sum(c["bytes"] for c in calls),
            "largest_all_reduce": max((c["bytes"] for c in calls), default=0),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def check(args, ctx, steps=4):
    """DiLoCo at H = 1 against DDP (float64, SGD); then the ranks' spread at H = 2."""
    tokens = shakespeare_bytes("train")

    def tiny():
        torch.manual_seed(args.seed)
        return TinyGPT(d_model=16, n_heads=2, n_layers=1, seq_len=16).to(ctx.device,
                                                                          torch.float64)

    def batches():
        gen = torch.Generator().manual_seed(args.seed + 1 + ctx.rank)
        return [tuple(t.to(ctx.device) for t in lm_batch(tokens, 4, 16, gen))
                for _ in range(steps)]

    ddp_model, diloco_model = tiny(), tiny()
    ddp = DDP(ddp_model) if ctx.world_size > 1 else ddp_model
    sgd = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    inner = torch.optim.SGD(diloco_model.parameters(), lr=0.1)
    outer = torch.optim.SGD(diloco_model.parameters(), lr=1.0)
    gaps = []
    with DiLoCo(diloco_model, inner, outer, sync_every=1):
        for x, y in batches():
            for m, opt in ((ddp, sgd), (diloco_model, inner)):
                lm_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
            gaps.append(max((a - b).abs().max().item() for a, b in
                            zip(ddp_model.parameters(), diloco_model.parameters())))
    model = tiny()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    spread = []
    with DiLoCo(model, inner, outer, sync_every=2) as d:
        for x, y in batches():
            lm_loss(model(x), y).backward()
            inner.step()
            inner.zero_grad()
            spread.append({"inner_step": d.inner_steps, "synced": d.inner_steps % 2 == 0,
                           "rank_spread": rank_spread(parameters_to_vector(model.parameters()))})
    return {"h1_vs_ddp_per_step": gaps, "h2_spread": spread}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        held = shakespeare_bytes("val")
        gen = torch.Generator().manual_seed(10_000)  # the same held-out batches everywhere
        held_out = [tuple(t.to(ctx.device) for t in lm_batch(held, 16, args.seq_len, gen))
                    for _ in range(args.eval_batches)]
        results = {"world_size": ctx.world_size, "device": str(ctx.device), "methods": {}}
        if "check" in args.part:
            results["check"] = check(args, ctx)
            log.info("DiLoCo at H=1 against DDP, largest gap per step: %s",
                     ", ".join(f"{g:.1e}" for g in results["check"]["h1_vs_ddp_per_step"]))
        methods = ["ddp"] + [f"diloco H={h}" for h in args.sync_every]
        for method in methods if "train" in args.part else []:
            r = results["methods"][method] = train(args, ctx, method, held_out)
            log.info("%-14s validation loss %.3f, %d all-reduces, %.1f MB sent", method,
                     r["evals"][-1]["val_loss"], r["all_reduces"], r["bytes"] / 1e6)
        if "streaming" in args.part:
            name = f"streaming H={args.sync_every[-1]} P={args.fragments}"
            r = results["streaming"] = train(args, ctx, name, held_out)
            r["method"] = name
            log.info("%s: validation loss %.3f, %d all-reduces, the largest %d bytes", name,
                     r["evals"][-1]["val_loss"], r["all_reduces"], r["largest_all_reduce"])
        if "labs" in args.part:
            h = f"diloco H={args.sync_every[0]}"
            results["labs"] = {
                "every rank loads": train(args, ctx, h, held_out),
                "the last rank keeps its own": train(args, ctx, h, held_out,
                                                     diloco=ForgetsToLoad),
                f"outer lr {args.lab_outer_lr}": train(args, ctx, h, held_out,
                                                       outer_lr=args.lab_outer_lr),
            }
            for name, r in results["labs"].items():
                log.info("lab, %-28s validation loss %.3f, ranks apart after syncs %s", name,
                         r["evals"][-1]["val_loss"],
                         ", ".join(f"{e['rank_spread']:.1e}" for e in r["evals"]))
        write_results(ctx, args.results, results, args=vars(args))


if __name__ == "__main__":
    main()
