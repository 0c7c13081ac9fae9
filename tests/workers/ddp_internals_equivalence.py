"""Worker: NaiveDDP and BucketedDDP against torch's DDP and one process on the global batch.

Launched by tests/multiprocess/test_ddp.py with 2 and 3 ranks; it checks many
cases in one job and writes what it measured to ``--results`` (rank 0), so the
test asserts on numbers, not on "it ran". Every rank trains, besides the
wrapped model, a plain reference model on the whole global batch.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
import worker_checks  # tests/workers/, the script's folder
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.ddp import BucketedDDP, NaiveDDP, average_gradients
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(steps=4, batch_size=4)


class Net(nn.Module):
    """Tied weights (b.weight is a.weight), a frozen layer, a layer used on request."""

    def __init__(self, width: int = 16, norm: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.b.weight = self.a.weight
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if norm else nn.Identity()
        self.head = nn.Linear(width, 4)

    def forward(self, x, use_extra: bool = True):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.a(h))
        h = torch.relu(self.b(h))
        h = self.frozen(h)
        if use_extra:
            h = h + self.sometimes(h)
        return self.head(self.norm(h))


def build(rank: int, norm: bool = False) -> nn.Module:
    torch.manual_seed(0 if rank == 0 else 1000 + rank)  # DDP must broadcast rank 0's
    return Net(norm=norm)


def sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def batches(n, b, steps, seed=123):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n * b, 8, generator=gen), torch.randint(0, 4, (n * b,), generator=gen))
        for _ in range(steps)
    ]


def max_diff(m1: nn.Module, m2: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(m1.parameters(), m2.parameters()))


def grads_equal_across_ranks(model: nn.Module, n: int) -> bool:
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


with distributed() as ctx:
    n, rank, b = ctx.world_size, ctx.rank, args.batch_size
    mine = slice(rank * b, (rank + 1) * b)
    # Counts the course's all-reduces from the dispatcher, whatever code issued them.
    log = CollectiveLog()
    results = {"world_size": n, "cases": {}}

    def train(kind: str, cap_mb: float | None, sometimes: bool):
        """Run ``args.steps`` steps; return (max |param - reference|, |param - torch DDP|, info)."""
        find_unused = sometimes
        reference, torch_local, local = Net(), build(rank), build(rank)
        reference.load_state_dict(build(0).state_dict())
        torch_ddp = DDP(torch_local, find_unused_parameters=find_unused)
        if kind == "naive":
            model = NaiveDDP(local)
        elif kind == "manual":
            model = local
            local.load_state_dict(build(0).state_dict())
        else:
            model = BucketedDDP(local, bucket_cap_mb=cap_mb, find_unused_parameters=find_unused)
        broadcast_ok = max_diff(local, reference) == 0.0
        opts = [sgd(m) for m in (reference, torch_ddp, model)]
        calls, info = [], {"broadcast_ok": broadcast_ok}
        for step, (x, y) in enumerate(batches(n, b, args.steps)):
            use_extra = step % 2 == 0 if sometimes else True
            for m, o, xs, ys in (
                (reference, opts[0], x, y),
                (torch_ddp, opts[1], x[mine], y[mine]),
                (model, opts[2], x[mine], y[mine]),
            ):
                o.zero_grad()
                # Only the course's model is recorded: torch's DDP all-reduces too.
                with log.recording(step) if m is model else contextlib.nullcontext():
                    F.cross_entropy(m(xs, use_extra), ys).backward()
                    if kind == "manual" and m is model:
                        average_gradients(model)
                if m is model:
                    calls.append(sum(c["op"] == "all_reduce" for c in log.calls))
                    log.calls.clear()
                o.step()
        info["calls_per_step"] = calls
        if kind == "bucketed":
            info["buckets"] = model.bucket_names()
            info["bucket_bytes"] = model.bucket_bytes()
            info["events"] = model.events
        return max_diff(local, reference), max_diff(local, torch_local), info

    total_bytes = sum(p.numel() * 4 for p in Net().parameters() if p.requires_grad)
    caps = {"one_bucket": 100.0, "two_buckets": total_bytes / 2 / 2**20, "per_param": 1e-9}
    for sometimes in (False, True):
        for cap_name, cap in caps.items():
            name = f"bucketed/{cap_name}/{'sometimes' if sometimes else 'always'}"
            d_ref, d_torch, info = train("bucketed", cap, sometimes)
            results["cases"][name] = {"diff_ref": d_ref, "diff_torch": d_torch, **info}
    for kind in ("naive", "manual"):
        d_ref, d_torch, info = train(kind, None, False)
        results["cases"][f"{kind}/always"] = {"diff_ref": d_ref, "diff_torch": d_torch, **info}

    # NaiveDDP and BucketedDDP(find_unused_parameters=False) name an unused parameter.
    errors = {}
    for kind in ("naive", "bucketed"):
        model = NaiveDDP(build(rank)) if kind == "naive" else BucketedDDP(build(rank))
        x, y = batches(n, b, 1)[0]
        try:
            F.cross_entropy(model(x[mine], use_extra=False), y[mine]).backward()
            errors[kind] = None
        except RuntimeError as exc:
            errors[kind] = str(exc)
    results["unused_errors"] = errors

    # no_sync: k micro-batches (k - 1 inside no_sync) == one step on the k-times batch.
    k = 3
    reference, local, torch_local = Net(), build(rank), build(rank)
    reference.load_state_dict(build(0).state_dict())
    wrapped = {"bucketed": BucketedDDP(local, bucket_cap_mb=1e-3), "torch": DDP(torch_local)}
    opts = {"reference": sgd(reference), **{key: sgd(m) for key, m in wrapped.items()}}
    micro_equal = {"bucketed": [], "torch": []}
    for x, y in batches(n, k * b, 2, seed=7):
        opts["reference"].zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opts["reference"].step()
        chunks = [torch.arange(n * k * b).view(n, k, b)[rank, i] for i in range(k)]
        for key, m in wrapped.items():
            opts[key].zero_grad()
            for i, idx in enumerate(chunks):
                # forward and backward inside no_sync for all but the last micro-batch
                with m.no_sync() if i < k - 1 else contextlib.nullcontext():
                    (F.cross_entropy(m(x[idx]), y[idx]) / k).backward()
                micro_equal[key].append(grads_equal_across_ranks(m.module, n))
            opts[key].step()
    results["no_sync"] = {
        "k": k,
        "diff_ref": max_diff(local, reference),
        "diff_torch": max_diff(local, torch_local),
        "grads_equal_after_each_micro_step": micro_equal,
    }

    # broadcast_buffers: BatchNorm running statistics follow torch's DDP on every rank.
    local, torch_local = build(rank, norm=True), build(rank, norm=True)
    ours, theirs = BucketedDDP(local), DDP(torch_local)
    o1, o2 = sgd(ours), sgd(theirs)
    gen = torch.Generator().manual_seed(rank)  # each rank sees different data
    for _ in range(3):
        x, y = torch.randn(b, 8, generator=gen) * 3 + rank, torch.randint(0, 4, (b,), generator=gen)
        for m, o in ((ours, o1), (theirs, o2)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    bn_diff = max(
        (p - q).abs().max().item()
        for p, q in zip(local.state_dict().values(), torch_local.state_dict().values())
        if p.is_floating_point()
    )
    stats = local.norm.running_mean.clone()
    everyone = [torch.empty_like(stats) for _ in range(n)]
    dist.all_gather(everyone, stats)
    results["buffers"] = {
        "diff_torch": bn_diff,
        "running_mean_differs_across_ranks": not torch.equal(everyone[0], everyone[-1]),
    }

    # Bad input.
    bad = {}
    try:
        BucketedDDP(build(rank), bucket_cap_mb=0)
    except ValueError as exc:
        bad["cap"] = str(exc)
    try:
        BucketedDDP(Net(width=16 + rank))
    except ValueError as exc:
        bad["shapes"] = str(exc)
    results["bad_input"] = bad

    gathered = [None] * n
    dist.all_gather_object(gathered, results)
    write_results(ctx, args.results, {"world_size": n, "per_rank": gathered})
