"""Context parallelism: attention over a sequence split across ranks, checked against one process.

Run from the repository root:
    python scripts/15_context_parallel.py
    torchrun --nproc_per_node=2 scripts/15_context_parallel.py
    torchrun --nproc_per_node=4 scripts/15_context_parallel.py --t-local 64

Every rank builds the same whole-sequence q, k, v (same seed) and keeps its own
tokens, contiguous or zig-zag. Ring attention, DeepSpeed-Ulysses and the
all-gather version each compute this rank's attention; the script compares
the output and the q, k, v gradients with scaled_dot_product_attention on the
whole sequence in one process (float64 and float32, causal and with packed
documents), counts the block products each rank computes (ring attention
given a counting block attention, RingOps) and the bytes each rank sends in
forward and backward (with the course's CollectiveLog: every send and
all-to-all), shows four
mistakes (document boundaries ignored; a causal mask per chunk; documents
numbered per rank; torch's deprecated differentiable all_gather), tries
PyTorch's own context_parallel, measures ring attention in bfloat16
with float32 and with bfloat16 accumulators, and measures, in one process, the
error of the merged attention in bfloat16 as the number of key chunks grows.
Last, a TinyGPT on the ranks (ring attention, zig-zag placement, global
positions, the loss over the whole sequence, gradients summed over the ranks)
against the same model on the whole sequence in one process, float64, with three
pieces broken on purpose; and the bytes its attention saves for backward per
rank, ring against all-gather, on groups of 1, 2, 4... ranks.
Results go to --results (rank 0).
"""

import argparse
import warnings

import torch
import torch.distributed as dist

from ddp_course import context_parallel as cp
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.runtime import distributed, get_logger, no_tf32
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results
from ddp_course.tools.saved_tensors import SavedTensorCounter

try:  # deprecated by torch; once removed, the notebook skips the all-gather trap
    from torch.distributed.nn.functional import all_gather as torch_all_gather
except ImportError:
    torch_all_gather = None
METHODS = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention,
           "all-gather": cp.allgather_attention}
# bfloat16 keeps 8 significant bits: rounding x once moves it by at most 2^-8 |x|.
BF16_ROUNDING = 2.0**-8
# The TinyGPT of the last part: tiny, so that the whole check costs little.
GPT = {"vocab_size": 64, "d_model": 16, "n_heads": 2, "n_layers": 2}
GPT_MISTAKES = ("local positions", "no gradient reduction", "local mean loss")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    p.add_argument(
        "--n-heads", type=int, default=4, help="attention heads (Ulysses: divisible by ranks)"
    )
    p.add_argument("--t-local", type=int, default=16, help="tokens per rank (even, for zig-zag)")
    p.add_argument("--head-dim", type=int, default=8, help="features per head")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="key chunks of the one-process bfloat16 sweep")
    p.add_argument("--gpt-tokens", type=int, default=32,
                   help="tokens of the TinyGPT's sequence (a multiple of 2 x ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


def whole(args, world_size, dtype, device, batch=None, heads=None):
    """q, k, v and an output gradient over the whole sequence: the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed)
    shape = (
        batch or args.batch_size,
        heads or args.n_heads,
        world_size * args.t_local,
        args.head_dim,
    )
    return [torch.randn(shape, generator=gen, dtype=dtype).to(device) for _ in range(4)]


def documents(t):
    """Packed documents of 5, 1, 7, 3, 9, 2, ... tokens: rank boundaries cut through them."""
    ids, doc, lengths = [], 0, [5, 1, 7, 3, 9, 2]
    while len(ids) < t:
        ids += [doc] * lengths[doc % len(lengths)]
        doc += 1
    return torch.tensor(ids[:t])


def max_diffs(ctx, args, fn, dtype, layout="contiguous", docs=None, ref_docs="same", **kw):
    """Largest |ours - one process| of the output and of the q, k, v gradients on this rank."""
    ref_docs = docs if ref_docs == "same" else ref_docs
    q, k, v, grad = whole(args, ctx.world_size, dtype, ctx.device, kw.pop("batch", None),
                          kw.pop("heads", None))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = cp.reference_attention(*ref_in, causal=True, document_ids=ref_docs)
    (ref * grad).sum().backward()

    def mine(x):
        return cp.shard_sequence(x, ctx.rank, ctx.world_size, layout)

    # NEW: each rank holds T/P tokens; the ranks exchange keys and values.
    local = [mine(x).clone().requires_grad_() for x in (q, k, v)]
    out = fn(*local, causal=True, layout=layout, document_ids=docs, **kw)
    (out * mine(grad)).sum().backward()
    pairs = [(out, mine(ref))] + [(a.grad, mine(b.grad)) for a, b in zip(local, ref_in)]
    return dict(zip(["output", "dq", "dk", "dv"], ((a - b).abs().max().item() for a, b in pairs)))


def every_chunk_starts_the_sequence():
    """The mistake: each rank numbers its tokens from 0, as if its chunk began the sequence,
    so every block gets a causal triangle of its own (ring attention's pieces with that
    placement; only the ring's masks use it, the sharding stays right)."""
    return cp.RingOps(segments=lambda rank, p, t, layout: cp.sequence_segments(0, p, t, layout))


def numbered_per_rank(docs, world_size):
    """The mistake: each rank numbers the documents it holds from 0 and the ranks' ids are
    put together: ids repeat across ranks, and a document cut by a rank boundary is split."""
    ids = []
    for chunk in docs.chunk(world_size):
        starts = torch.cat([torch.zeros(1, dtype=torch.long), (chunk[1:] != chunk[:-1]).long()])
        ids.append(starts.cumsum(0))
    return torch.cat(ids)


def counting_blocks(log):
    """Ring attention's pieces with a block attention that adds to ``log`` each block
    product this rank computes and its visible query-key pairs."""

    def block_counted(q, k, v, mask):
        log["blocks"] += 1
        log["visible"] += q.shape[2] * k.shape[2] if mask is None else int(mask.sum())
        return cp.block_attention(q, k, v, mask)

    return cp.RingOps(block=block_counted)


def counted(ctx, args, fn, layout="contiguous"):
    """float32: bytes sent in forward and in backward; blocks and visible pairs in forward."""
    q, k, v, grad = whole(args, ctx.world_size, torch.float32, ctx.device)

    def mine(x):
        return cp.shard_sequence(x, ctx.rank, ctx.world_size, layout)

    local = [mine(x).requires_grad_() for x in (q, k, v)]
    log, sends = {"blocks": 0, "visible": 0}, CollectiveLog()
    # Only the ring computes blocks; Ulysses' count stays 0.
    kw = {"ops": counting_blocks(log)} if fn is cp.ring_attention else {}
    with sends.recording("forward"):
        out = fn(*local, causal=True, layout=layout, **kw)
    with sends.recording("backward"):
        (out * mine(grad)).sum().backward()
    # A ring passes blocks by send and receive, Ulysses by all-to-all: the bytes that leave.
    moved = ("send", "recv", "all_to_all")
    sent = {phase: sum(c["sent"] for c in sends.calls if c["phase"] == phase and c["op"] in moved)
            for phase in ("forward", "backward")}
    return {"bytes": sent["forward"], "backward_bytes": sent["backward"], **log}


def torch_gather(x, group=None):
    """torch's differentiable all_gather (deprecated), concatenated along the sequence."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.cat(torch_all_gather(x, group), dim=2)


def torch_context_parallel(ctx, args):
    """PyTorch's context_parallel on this device: its error, or its difference from one process.

    On a CPU, rank 0 tries it alone, on a mesh of one rank: the refusal comes from the CPU
    attention kernel, whatever the number of ranks, and the other ranks skip the cost.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    alone = ctx.device.type == "cpu"
    one = dist.new_group([0]) if alone else None  # every rank takes part in new_group
    if alone and ctx.rank != 0:
        return None
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    try:  # which way it passes K and V by default (private: may move)
        from torch.distributed.tensor.experimental._attention import _cp_options

        rotate = _cp_options.rotate_method.name
    except (ImportError, AttributeError):
        rotate = None
    n = 1 if alone else ctx.world_size
    mesh = DeviceMesh.from_group(one, "cpu") if alone else init_device_mesh(ctx.device.type, (n,))
    q, k, v, _ = whole(args, n, torch.float32, ctx.device)
    ref = cp.reference_attention(q, k, v, causal=True)
    buffers = [x.clone() for x in (q, k, v)]  # sharded in place, so not leaves of a graph
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            out = torch.nn.functional.scaled_dot_product_attention(*buffers, is_causal=True)
        (out,) = context_parallel_unshard(mesh, [out], [2])
    except Exception as e:  # recorded, not hidden: the notebook shows it
        return {"ran": False, "ranks": n, "default_rotate_method": rotate,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    finally:  # torch 2.11 leaves it wrapped for DTensors after the block
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return {"ran": True, "ranks": n, "default_rotate_method": rotate,
            "max_diff": (out - ref).abs().max().item()}


def ring_bf16(ctx, args):
    """Ring attention on bfloat16 q, k, v against float64 on the same values, all ranks.

    For float32 (the default) and bfloat16 accumulators: the largest |ours - exact|
    of the output and of the q, k, v gradients, and the most it goes past one
    bfloat16 rounding of the exact value, 2^-8 |exact| (<= 0: within it).
    """
    q, k, v, grad = (x.to(torch.bfloat16).double()
                     for x in whole(args, ctx.world_size, torch.float64, ctx.device))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = cp.reference_attention(*ref_in, causal=True)
    (ref * grad).sum().backward()

    def mine(x):
        return cp.shard_sequence(x, ctx.rank, ctx.world_size)

    exact = [mine(x) for x in (ref, *(x.grad for x in ref_in))]
    names, rows = ["output", "dq", "dk", "dv"], {}
    for acc, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        local = [mine(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
        out = cp.ring_attention(*local, causal=True, accumulate_dtype=dtype)
        (out.double() * mine(grad)).sum().backward()
        errors = [(a.double() - b).abs() for a, b in zip([out, *(x.grad for x in local)], exact)]
        worst = torch.stack(
            [e.max() for e in errors]
            + [(e - BF16_ROUNDING * b.abs()).max() for e, b in zip(errors, exact)]
        )
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank
        rows[acc] = {"max_error": dict(zip(names, worst[:4].tolist())),
                     "beyond_one_rounding": dict(zip(names, worst[4:].tolist()))}
    return rows


def bf16_sweep(args, device):
    """One process: merged attention over n key chunks in float32 and bfloat16, against float64."""
    gen = torch.Generator().manual_seed(args.seed)
    t = max(args.chunks) * 8
    q, k, v = (torch.randn(1, args.n_heads, t, args.head_dim, generator=gen, dtype=torch.float64)
               .to(device) for _ in range(3))
    exact = cp.reference_attention(q, k, v, causal=True)
    rows = []
    for n in args.chunks:
        row = {"chunks": n, "tokens": t}
        for name, dtype, acc in (
            ("float32", torch.float32, None),
            ("bfloat16", torch.bfloat16, None),
            ("bfloat16, float32 merge", torch.bfloat16, torch.float32),
        ):
            x = (t.to(dtype) for t in (q, k, v))
            got = cp.blockwise_attention(*x, n, causal=True, accumulate_dtype=acc)
            row[name] = (got.double() - exact).abs().max().item()
        rows.append(row)
    return rows


def gpt_and_tokens(ctx, args):
    """The TinyGPT (float64) and a batch of token sequences: the same on every rank."""
    torch.manual_seed(args.seed)
    model = TinyGPT(**GPT, seq_len=args.gpt_tokens).double().to(ctx.device)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(GPT["vocab_size"], (args.batch_size, args.gpt_tokens + 1), generator=gen)
    return model, tokens.to(ctx.device)


def gpt_reference(ctx, args):
    """One process, the whole sequence: the loss and every parameter's gradient."""
    model, tokens = gpt_and_tokens(ctx, args)
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def gpt_run(ctx, args, group, attention=cp.ring_attention, mistake=None):
    """The TinyGPT on this rank's tokens of ``group``: one forward and backward.

    Returns the loss summed over the group, the parameters' gradients (summed over the
    group unless ``mistake`` skips it) and the bytes the attention cores saved for
    backward on this rank (``SavedTensorCounter`` around each core). ``mistake``: one
    of ``GPT_MISTAKES``.
    """
    model, tokens = gpt_and_tokens(ctx, args)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    inputs, targets = (cp.shard_sequence(x, rank, size, "zigzag", dim=1)
                       for x in (tokens[:, :-1], tokens[:, 1:]))
    saved = SavedTensorCounter()

    def counted(q, k, v, **kw):
        with saved:  # the innermost hooks count: only what the core saves
            return attention(q, k, v, **kw)

    gpt = cp.ContextParallelGPT(model, group, "zigzag", counted)
    # NEW: global positions, the loss over all tokens, gradients summed over the ranks.
    logits = model(inputs) if mistake == "local positions" else gpt(inputs)
    if mistake == "local mean loss":
        loss = lm_loss(logits, targets)
    else:
        loss = cp.context_parallel_loss(logits, targets, group)
    loss.backward()
    if mistake != "no gradient reduction":
        cp.reduce_gradients(model, group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total, {n: p.grad for n, p in model.named_parameters()}, saved.activation_bytes


def gpt_check(ctx, args):
    """TinyGPT over context-parallel groups of 1, 2, 4... ranks against one process.

    For each group size p dividing the world (the world cut into groups of p
    consecutive ranks): ring attention and all-gather, the largest |ours - one
    process| of the loss and of any gradient (worst rank), and the bytes each
    rank's attention saved; on the whole world, the three mistakes too.
    """
    ref_loss, ref_grads = gpt_reference(ctx, args)
    n, rows, mistakes = ctx.world_size, [], {}

    def worst(run):
        loss, grads, saved = run
        grad_diff = max((grads[k] - g).abs().max().item() for k, g in ref_grads.items())
        diffs = torch.tensor([(loss - ref_loss).abs().item(), grad_diff], device=ctx.device)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)  # every rank's, the worst
        return {"loss": diffs[0].item(), "gradients": diffs[1].item(), "saved_bytes": saved}

    sizes = [p for p in (2**i for i in range(n.bit_length())) if n % p == 0]
    for p in sizes:
        groups = [dist.new_group(list(range(s, s + p))) for s in range(0, n, p)] if p < n else None
        group = None if groups is None else groups[ctx.rank // p]  # every rank made every group
        for name, fn in (("ring", cp.ring_attention), ("all-gather", cp.allgather_attention)):
            rows.append({"ranks": p, "attention": name, **worst(gpt_run(ctx, args, group, fn))})
    for mistake in GPT_MISTAKES:
        mistakes[mistake] = worst(gpt_run(ctx, args, None, mistake=mistake))
        del mistakes[mistake]["saved_bytes"]
    heads = GPT["n_heads"]
    shape = [args.batch_size, heads, args.gpt_tokens // n, GPT["d_model"] // heads]
    config = {**GPT, "tokens": args.gpt_tokens, "batch_size": args.batch_size}
    return {"config": config, "rows": rows, "mistakes": mistakes, "local_qkv_shape": shape}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        no_tf32()  # float32 compared to 1e-5, also on a GPU: no TensorFloat-32 matmuls
        n, docs = ctx.world_size, documents(ctx.world_size * args.t_local)
        diffs = {}
        for dtype in (torch.float64, torch.float32):
            for name, fn in METHODS.items():
                for layout in ("contiguous", "zigzag"):
                    for masking, d in (("causal", None), ("documents", docs)):
                        key = f"{name} {layout} {masking} {str(dtype).removeprefix('torch.')}"
                        diffs[key] = max_diffs(ctx, args, fn, dtype, layout, docs=d)
        mistakes = {
            "documents ignored": max_diffs(
                ctx, args, cp.ring_attention, torch.float64, docs=None, ref_docs=docs
            ),
            "documents masked": max_diffs(ctx, args, cp.ring_attention, torch.float64, docs=docs),
            "causal mask per chunk": max_diffs(ctx, args, cp.ring_attention, torch.float64,
                                               ops=every_chunk_starts_the_sequence()),
            "documents numbered per rank": max_diffs(
                ctx, args, cp.ring_attention, torch.float64, docs=numbered_per_rank(docs, n),
                ref_docs=docs),
        }
        for b, h in ((2, 3), (1, 3), (2, 1), (1, 1)):
            if torch_all_gather is not None:
                mistakes[f"torch all_gather, batch {b}, heads {h}"] = max_diffs(
                    ctx, args, cp.allgather_attention, torch.float64, batch=b, heads=h,
                    gather=torch_gather)
            mistakes[f"gather_sequence, batch {b}, heads {h}"] = max_diffs(
                ctx, args, cp.allgather_attention, torch.float64, batch=b, heads=h
            )
        counts = {"ring contiguous": counted(ctx, args, cp.ring_attention),
                  "ring zigzag": counted(ctx, args, cp.ring_attention, "zigzag"),
                  "ulysses": counted(ctx, args, cp.ulysses_attention)}
        everyone = [None] * n
        dist.all_gather_object(everyone, counts)
        theirs = torch_context_parallel(ctx, args)
        refused = None
        if n > 1:  # n + 1 heads: no world size above 1 divides them
            q = torch.zeros(1, n + 1, args.t_local, args.head_dim, device=ctx.device)
            try:
                cp.ulysses_attention(q, q, q)
            except ValueError as e:
                refused = str(e)
        local_shape = [args.batch_size, args.n_heads, args.t_local, args.head_dim]
        result = {
            "world_size": n, "device": str(ctx.device), "local_shape": local_shape,
            "diffs": diffs, "mistakes": mistakes, "counts": everyone,
            "formulas": {"ring": cp.ring_attention_bytes(local_shape, 4, n),
                         "ulysses": cp.ulysses_bytes(local_shape, 4, n),
                         "ring backward": cp.ring_backward_bytes(local_shape, 4, n),
                         "ulysses backward": cp.ulysses_backward_bytes(local_shape, 4, n)},
            "torch_context_parallel": theirs, "ulysses_refused": refused,
            "ring_bf16": ring_bf16(ctx, args),
            "bf16_sweep": bf16_sweep(args, ctx.device) if ctx.rank == 0 else None,
            "gpt": gpt_check(ctx, args),
        }
        worst = max(max(d.values()) for k, d in diffs.items() if "float64" in k)
        verdict = ("skipped on this rank" if theirs is None else "ran" if theirs["ran"]
                   else f"refused ({theirs['error'].split(':')[0]})")
        sent = {k: c["bytes"] for k, c in counts.items()}
        log.info(f"{n} ranks: ring, Ulysses, all-gather within {worst:.1e} of one process "
                 f"(float64); bytes sent by rank 0 in forward {sent}; "
                 f"torch context_parallel {verdict}")
        write_results(ctx, args.results, result)


if __name__ == "__main__":
    main()
