"""Worker: tensor- and sequence-parallel TinyGPT blocks against one process, broken on purpose.

Every rank builds the same TinyGPT (same seed, float64) and the single-process
reference. For each variant (as written, and three mistakes patched in), it
measures without asserting in between, so every rank always runs the same
collectives even when a check fails:

- one block, forward and backward, tensor-parallel (TP) and with sequence
  parallelism (SP): output, input gradient, every gathered parameter
  gradient against the one-process block; the collectives of each phase
  (``CollectiveLog``, from the dispatcher);
- the whole TinyGPT trained ``--steps`` SGD steps on the same batch: the
  gathered parameters against one process, and the replicated parameters
  across the tensor-parallel ranks; the collectives of one step;
- (as written only) the bytes the LayerNorms and a whole block save for
  backward, and the initialisation-seed lab. Dropout across ranks:
  ``tp_dropout_check.py``.

    torchrun --nproc_per_node=2 tests/workers/tp_gpt_check.py
"""

import contextlib

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch.nn import functional
from worker_checks import mismatch

from ddp_course import sequence_parallel as sp
from ddp_course import tensor_parallel as tp
from ddp_course.models import Block, TinyGPT, lm_loss
from ddp_course.parallel_gpt import ParallelGPT, gather_full_state
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results
from ddp_course.tools.saved_tensors import saved_activation_bytes

args = worker_checks.parse_args(**worker_checks.TINY_GPT, steps=5)

BLOCK_TOL = {"rtol": 1e-12, "atol": 1e-12}
GPT_TOL = {"rtol": 1e-10, "atol": 1e-10}
VARIANTS = (
    "as_written",
    "f_backward_without_all_reduce",
    "sp_without_all_gather",
    "ln_grad_not_reduced",
)


def my_part(x, ctx):
    return x.chunk(ctx.world_size, dim=1)[ctx.rank]


@contextlib.contextmanager
def broken(variant):
    """The mistakes the checks must catch, patched in for the duration."""
    if variant == "f_backward_without_all_reduce":
        original, name = tp.CopyToParallel.backward, "backward"
        patched = staticmethod(lambda ctx, grad: (grad, None))
        owner = tp.CopyToParallel
    elif variant == "sp_without_all_gather":
        # The gathered buffer allocated and this rank's part written, the
        # all-gather itself forgotten: the other ranks' positions stay zero.
        def forward(ctx, x, group, *params):
            weights, biases = params[0::2], params[1::2]
            ctx.group, ctx.has_bias = group, [b is not None for b in biases]
            full = x.new_zeros(x.shape[0], x.shape[1] * dist.get_world_size(group), x.shape[2])
            full.narrow(1, dist.get_rank(group) * x.shape[1], x.shape[1]).copy_(x)
            ctx.save_for_backward(x, *weights)
            return tuple(functional.linear(full, w, b) for w, b in zip(weights, biases))

        original, name = sp.GatherLinear.forward, "forward"
        patched, owner = staticmethod(forward), sp.GatherLinear
    else:
        yield
        return
    setattr(owner, name, patched)
    try:
        yield
    finally:
        setattr(owner, name, original)


def finish_grads(model, variant, ctx):
    if variant != "ln_grad_not_reduced":
        sp.all_reduce_sequence_parallel_grads(model)


def check_block(ctx, variant, sequence_parallel):
    torch.manual_seed(0)
    ref = Block(args.d_model, args.n_heads, flash=False).double()
    par = sp.ParallelBlock(ref, ctx.rank, ctx.world_size, sequence_parallel=sequence_parallel)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, args.seq_len, args.d_model, generator=gen, dtype=torch.float64)
    target = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    x_ref, x_full = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref - target) ** 2).sum().backward()
    log = CollectiveLog()
    with broken(variant):
        x_in = my_part(x_full, ctx) if sequence_parallel else x_full
        with log.recording("forward"):
            out = par(x_in)
        t = my_part(target, ctx) if sequence_parallel else target
        with log.recording("backward"):
            ((out - t) ** 2).sum().backward()
        with log.recording("grads"):
            finish_grads(par, variant, ctx)
    want_out = my_part(out_ref, ctx) if sequence_parallel else out_ref
    want_xg = my_part(x_ref.grad, ctx) if sequence_parallel else x_ref.grad
    got_xg = my_part(x_full.grad, ctx) if sequence_parallel else x_full.grad
    fails = {
        "output": mismatch(out, want_out, **BLOCK_TOL),
        "input_grad": mismatch(got_xg, want_xg, **BLOCK_TOL),
    }
    grads = gather_full_state(par, grads=True)
    for name, q in ref.named_parameters():
        fails[f"grad {name}"] = mismatch(grads[name], q.grad, **BLOCK_TOL)
    return {"fails": fails, "calls": log.calls}


def replicas_disagree(model, ctx):
    """Names of replicated parameters whose value is not the same on every rank."""
    sharded = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear))
    }
    sharded |= {id(m.bias) for m in model.modules() if isinstance(m, tp.ColumnParallelLinear)}
    bad = []
    for name, q in model.named_parameters():
        if id(q) in sharded:
            continue
        copies = [torch.empty_like(q) for _ in range(ctx.world_size)]
        dist.all_gather(copies, q.detach().contiguous())
        if any(not torch.equal(c, copies[0]) for c in copies):
            bad.append(name)
    return bad


def gpt(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
        seq_len=args.seq_len,
        flash=False,
    ).double()


def lm_batch():
    gen = torch.Generator().manual_seed(2)  # the same batch on every rank
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def check_gpt(ctx, variant, sequence_parallel):
    ref = gpt()
    par = ParallelGPT(ref, ctx.rank, ctx.world_size, sequence_parallel=sequence_parallel)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_par = torch.optim.SGD(par.parameters(), lr=0.5)
    idx, targets = lm_batch()
    log = CollectiveLog()
    losses = []
    for step in range(args.steps):
        lm_loss(ref(idx), targets).backward()
        with broken(variant):
            with log.recording(f"forward {step}"):
                loss = lm_loss(par(idx), targets)
            with log.recording(f"backward {step}"):
                loss.backward()
            with log.recording(f"grads {step}"):
                finish_grads(par, variant, ctx)
        losses.append(loss.item())
        opt_ref.step(), opt_par.step()
        opt_ref.zero_grad(), opt_par.zero_grad()
    full = gather_full_state(par)
    fails = {
        f"after {args.steps} steps {name}": mismatch(full[name], q.detach(), **GPT_TOL)
        for name, q in ref.named_parameters()
    }
    step0 = [c for c in log.calls if c["phase"].endswith(" 0")]
    return {
        "fails": fails,
        "calls": step0,
        "replicas_disagree": replicas_disagree(par, ctx),
        "losses": losses,
        "params_per_rank": sum(q.numel() for q in par.parameters()),
        "params_whole": sum(q.numel() for q in ref.parameters()),
    }


def layernorm_bytes(ctx, sequence_parallel):
    """Bytes the two LayerNorms of one block save for backward, on this rank."""
    torch.manual_seed(0)
    par = sp.ParallelBlock(
        Block(args.d_model, args.n_heads, flash=False).double(),
        ctx.rank,
        ctx.world_size,
        sequence_parallel=sequence_parallel,
    )
    x = torch.randn(args.batch_size, args.seq_len, args.d_model, dtype=torch.float64)
    x = (my_part(x, ctx) if sequence_parallel else x).requires_grad_()
    out = {}
    with saved_activation_bytes([par.ln1, par.ln2], out):
        par(x).sum().backward()
    return out["bytes"]


def block_bytes(ctx, sequence_parallel):
    """Bytes one whole block (dropout on, explicit attention) saves for backward, on this
    rank, each storage once; and the shapes of what it saves."""
    torch.manual_seed(0)
    whole = Block(args.d_model, args.n_heads, dropout=0.1, flash=False).double()
    par = sp.ParallelBlock(whole, ctx.rank, ctx.world_size, sequence_parallel=sequence_parallel)
    x = torch.randn(args.batch_size, args.seq_len, args.d_model, dtype=torch.float64)
    x = (my_part(x, ctx) if sequence_parallel else x).requires_grad_()
    out = {}
    with saved_activation_bytes([par], out):
        y = par(x)
    y.sum().backward()
    return out


def seed_lab(ctx):
    """Lab 1a: each rank builds its own model with seed + rank, then shards it."""
    out = {}
    for name, seed in (("seed_plus_rank", ctx.rank), ("same_seed", 0)):
        par = ParallelGPT(gpt(seed), ctx.rank, ctx.world_size)
        full, ref = gather_full_state(par), gpt(0)
        out[name] = {
            "differ_from_one_process": sorted(
                n for n, q in ref.named_parameters() if not torch.equal(full[n], q.detach())
            ),
            "replicas_disagree": replicas_disagree(par, ctx),
        }
    return out


with distributed(device="cpu") as ctx:
    out = {"world_size": ctx.world_size, "variants": {}}
    for variant in VARIANTS:
        mine = {}
        for mode, sp_on in (("tp", False), ("sp", True)):
            mine[f"block {mode}"] = check_block(ctx, variant, sp_on)
            mine[f"gpt {mode}"] = check_gpt(ctx, variant, sp_on)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        out["variants"][variant] = gathered
    out["layernorm_bytes"] = {"tp": layernorm_bytes(ctx, False), "sp": layernorm_bytes(ctx, True)}
    out["block_bytes"] = {"tp": block_bytes(ctx, False), "sp": block_bytes(ctx, True)}
    out["seed_lab"] = seed_lab(ctx)
    # A sequence the ranks cannot share equally: a clear error on every rank, before
    # any collective (so no rank waits for the others).
    try:
        ParallelGPT(gpt(), ctx.rank, ctx.world_size, sequence_parallel=True)(
            torch.zeros(1, args.seq_len - 1, dtype=torch.long)
        )
        out["odd_sequence_error"] = None
    except ValueError as e:
        out["odd_sequence_error"] = str(e)
    write_results(ctx, args.results, out)
