"""Worker: dropout masks of the course's tensor- and sequence-parallel TinyGPT across ranks.

Every rank builds the same TinyGPT (same seed, float64, dropout 0.5, explicit attention)
and splits it with ``ParallelGPT``, with and without sequence parallelism. Two training
steps run with every dropout mask recorded (``sp.dropout_masks``); the masks of each call
are all-gathered and compared across ranks, and each rank compares step 0's with step 1's.
Then a few SGD steps with dropout on: the replicated parameters must still be equal on
every rank. As written, and with two mistakes patched in: the sharded regions drawing from
the default generator (``ParallelRNG.fork`` a no-op: every rank the same mask), and the
per-rank state re-seeded before every step (the same mask at every step).

    torchrun --nproc_per_node=2 tests/workers/tp_dropout_check.py
"""

import contextlib

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder

from ddp_course import sequence_parallel as sp
from ddp_course import tensor_parallel as tp
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.parallel_gpt import ParallelGPT
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(**worker_checks.TINY_GPT)

VARIANTS = (
    "as_written",
    "default_generator_everywhere",
    "reseeded_every_step",
    "default_generator_seed_plus_rank",
)


@contextlib.contextmanager
def broken(variant):
    if variant != "default_generator_everywhere":
        yield
        return
    original = tp.ParallelRNG.fork
    tp.ParallelRNG.fork = lambda self, device="cpu": contextlib.nullcontext()
    try:
        yield
    finally:
        tp.ParallelRNG.fork = original


def regions(sequence_parallel):
    """The region of each dropout call of one forward, in call order."""
    residual = "sequence shard" if sequence_parallel else "replicated residual"
    return ["replicated embeddings"] + ["heads", residual, residual] * args.n_layers


def model(ctx, variant, sequence_parallel):
    torch.manual_seed(0)  # the same weights and default generator on every rank
    whole = TinyGPT(
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
        seq_len=args.seq_len,
        dropout=0.5,
        flash=False,
    ).double()
    par = ParallelGPT(whole, ctx.rank, ctx.world_size, sequence_parallel=sequence_parallel)
    if variant == "default_generator_seed_plus_rank":
        torch.manual_seed(1 + ctx.rank)  # data parallelism's habit: the replicated masks differ
    return par


def batch():
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def equal_on_every_rank(mask, ctx):
    copies = [torch.empty_like(mask) for _ in range(ctx.world_size)]
    dist.all_gather(copies, mask.contiguous())
    return all(torch.equal(c, copies[0]) for c in copies)


def masks(ctx, variant, sequence_parallel):
    """Per region: equal on every rank (each call, each step), repeated from step 0 to 1."""
    par = model(ctx, variant, sequence_parallel)
    x, y = batch()
    steps = []
    with broken(variant):
        for _ in range(2):
            if variant == "reseeded_every_step":
                par.rng.states.clear()  # seeded again: region_seed's state from the start
            with sp.dropout_masks() as seen:
                lm_loss(par(x), y).backward()
            steps.append(seen)
    names = regions(sequence_parallel)
    out = {}
    for i, name in enumerate(names):
        row = out.setdefault(name, {"equal_on_every_rank": [], "repeats_next_step": []})
        row["equal_on_every_rank"] += [equal_on_every_rank(s[i], ctx) for s in steps]
        row["repeats_next_step"].append(torch.equal(steps[0][i], steps[1][i]))
        row["shape"] = list(steps[0][i].shape)
        row["dropped"] = steps[0][i].float().mean().item()
    return {"calls": [len(s) for s in steps], "expected_calls": len(names), "regions": out}


def replicas_disagree(ctx, variant, sequence_parallel, steps=3):
    """Replicated parameters no longer equal on every rank after SGD steps with dropout."""
    par = model(ctx, variant, sequence_parallel)
    opt = torch.optim.SGD(par.parameters(), lr=0.5)
    x, y = batch()
    with broken(variant):
        for _ in range(steps):
            lm_loss(par(x), y).backward()
            sp.all_reduce_sequence_parallel_grads(par)
            opt.step()
            opt.zero_grad()
    split = {
        id(m.weight)
        for m in par.modules()
        if isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear))
    }
    split |= {id(m.bias) for m in par.modules() if isinstance(m, tp.ColumnParallelLinear)}
    return [
        name
        for name, p in par.named_parameters()
        if id(p) not in split and not equal_on_every_rank(p.detach(), ctx)
    ]


with distributed(device="cpu") as ctx:
    out = {"world_size": ctx.world_size, "variants": {}}
    for variant in VARIANTS:
        mine = {}
        for mode, sp_on in (("tp", False), ("sp", True)):
            mine[mode] = masks(ctx, variant, sp_on)
            mine[mode]["replicas_disagree"] = replicas_disagree(ctx, variant, sp_on)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        out["variants"][variant] = gathered
    write_results(ctx, args.results, out)
