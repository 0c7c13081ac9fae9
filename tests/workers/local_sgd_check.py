"""Worker: DiLoCo and local SGD from scratch (ddp_course.local_sgd) against DDP and against
one another, in float64, plus broken variants.

Every rank builds the same MLP and trains on its own batches. Reports, from rank 0: the
gap of DiLoCo at H=1 (inner SGD, outer SGD lr 1, no momentum) to DDP; the gap between
ranks after every synchronisation at H=3 with AdamW inside and Nesterov SGD outside, and
between two synchronisations; the all-reduces per run (one per synchronisation, every
parameter's bytes); and the same checks with a pseudo-gradient of the wrong sign,
averaged over a group of one, and a rank that does not load the synchronised copy.
Streaming DiLoCo: with one fragment against DiLoCo; with two at H=4, after every inner
step, which fragment was synchronised, how far apart the ranks are per fragment, and the
bytes of each all-reduce; the same with a broken variant that always synchronises the
first fragment.

    torchrun --nproc_per_node=2 tests/workers/local_sgd_check.py --results r.json
"""

import contextlib

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from ddp_course.local_sgd import DiLoCo, StreamingDiLoCo, local_sgd
from ddp_course.models import MLP
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.debug import rank_spread
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(steps=6, batch_size=4, lr=0.05)


class WrongSign(DiLoCo):
    """Broken: the pseudo-gradient is the local parameters minus the last sync's."""

    def pseudo_gradients(self):
        return [-d for d in super().pseudo_gradients()]


class NoLoad(DiLoCo):
    """Broken: rank 1 steps the outer optimizer but keeps training from its own copy."""

    def sync(self):
        mine = [p.detach().clone() for p in self.params]
        super().sync()
        if dist.get_rank() == 1:
            with torch.no_grad():
                for p, m in zip(self.params, mine):
                    p.copy_(m)


class StuckFragment(StreamingDiLoCo):
    """Broken: every synchronisation is of the first fragment."""

    def sync(self, indices=None):
        super().sync(self.fragments[0])


def streaming_run(rank, fragments, cls=StreamingDiLoCo, sync_every=4, steps=8):
    """AdamW inside, Nesterov outside; per inner step: the fragment synchronised (or
    None), each fragment's spread over the ranks, and the bytes all-reduced."""
    m = model()
    inner = torch.optim.AdamW(m.parameters(), lr=args.lr)
    outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    log, seen = CollectiveLog(), []
    with cls(m, inner, outer, sync_every, fragments) as d:
        params = list(m.parameters())
        for step in range(steps):
            loss(m, *batch(step, rank)).backward()
            syncs = d.syncs
            with log.recording(f"step {step}"):
                inner.step()
            inner.zero_grad()
            per_fragment = [
                rank_spread(parameters_to_vector([params[i] for i in f])) for f in d.fragments
            ]
            bytes_sent = [c["bytes"] for c in log.calls if c["phase"] == f"step {step}"]
            seen.append(
                {
                    "synced": d.last_fragment if d.syncs > syncs else None,
                    "spread": per_fragment,
                    "bytes": bytes_sent,
                }
            )
    sizes = [sum(params[i].numel() * 8 for i in f) for f in d.fragments]
    return parameters_to_vector(m.parameters()).detach(), seen, sizes


def model():
    torch.manual_seed(0)
    return MLP(8, 16, 2, 4).double()


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(args.batch_size, 8, dtype=torch.float64, generator=g), torch.randint(
        0, 4, (args.batch_size,), generator=g
    )


def loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def spread(m):
    """Largest difference between any rank's parameters and rank 0's."""
    return rank_spread(parameters_to_vector(m.parameters()))


def ddp_run(rank):
    m = model()
    ddp = DDP(m)
    opt = torch.optim.SGD(m.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss(ddp, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    return parameters_to_vector(m.parameters()).detach()


def diloco_run(rank, cls=DiLoCo, sync_every=1, adam=False, group=None, log=None):
    m = model()
    if adam:
        inner = torch.optim.AdamW(m.parameters(), lr=args.lr)
        outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    else:
        inner = torch.optim.SGD(m.parameters(), lr=args.lr)
        outer = torch.optim.SGD(m.parameters(), lr=1.0)
    after_sync, between = [], []
    with cls(m, inner, outer, sync_every, group=group) as d:
        for step in range(args.steps):
            loss(m, *batch(step, rank)).backward()
            with log.recording(f"step {step}") if log else contextlib.nullcontext():
                inner.step()
            inner.zero_grad()
            (after_sync if (step + 1) % sync_every == 0 else between).append(spread(m))
    return parameters_to_vector(m.parameters()).detach(), after_sync, between, d


with distributed() as ctx:
    out = {"world_size": ctx.world_size}
    reference = ddp_run(ctx.rank)
    h1, _, _, _ = diloco_run(ctx.rank)
    out["h1_vs_ddp"] = (h1 - reference).abs().max().item()
    log = CollectiveLog()
    _, after, between, d = diloco_run(ctx.rank, sync_every=3, adam=True, log=log)
    out["h3"] = {
        "after_sync": after,
        "between": between,
        "syncs": d.syncs,
        "all_reduces": log.summary().get("all_reduce", []),
        "param_bytes": sum(p.numel() * 8 for p in model().parameters()),
    }
    avg, _, _, _ = diloco_run(ctx.rank, cls=DiLoCo, sync_every=2)
    m = model()
    inner = torch.optim.SGD(m.parameters(), lr=args.lr)
    with local_sgd(m, inner, 2):
        for step in range(args.steps):
            loss(m, *batch(step, ctx.rank)).backward()
            inner.step()
            inner.zero_grad()
    out["local_sgd_vs_diloco_lr1"] = (
        (parameters_to_vector(m.parameters()).detach() - avg).abs().max().item()
    )
    wrong, _, _, _ = diloco_run(ctx.rank, cls=WrongSign)
    out["wrong_sign_vs_ddp"] = (wrong - reference).abs().max().item()
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank creates each
    _, after_alone, _, _ = diloco_run(ctx.rank, sync_every=3, adam=True, group=groups[ctx.rank])
    out["group_of_one_after_sync"] = after_alone
    _, after_noload, _, _ = diloco_run(ctx.rank, cls=NoLoad, sync_every=3, adam=True)
    out["no_load_after_sync"] = after_noload
    one, _, _ = streaming_run(ctx.rank, 1, sync_every=3, steps=args.steps)
    plain, _, _, _ = diloco_run(ctx.rank, sync_every=3, adam=True)
    out["streaming_p1_vs_diloco"] = (one - plain).abs().max().item()
    _, seen, sizes = streaming_run(ctx.rank, 2)
    out["streaming_p2"] = {"steps": seen, "fragment_bytes": sizes}
    _, stuck, _ = streaming_run(ctx.rank, 2, cls=StuckFragment)
    out["streaming_stuck"] = {"steps": stuck}
    write_results(ctx, args.results, out)
