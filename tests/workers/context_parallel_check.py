"""Worker: context-parallel attention against one process, counted and broken on purpose.

Every rank builds the same whole-sequence q, k, v (same seed), takes its own
tokens (contiguous or zig-zag) and compares ring attention, Ulysses and the
all-gather version with ``scaled_dot_product_attention`` on the whole sequence:
outputs and q/k/v gradients, float64 and float32, causal and with packed
documents. Nothing asserts in between (every rank must run the same collectives
even when a check fails): each check records None or what differed. It counts
the block products each rank computes (a counting block attention given to ring
attention through ``RingOps``) and the
bytes each rank sends in forward and backward (``CollectiveLog``: each send
and all-to-all), and logs the order
in which ring attention posts its passes, computes its blocks and waits. Then
it runs the mistakes the checks must catch: merging without the log-sum-exp
correction, the causal mask applied per chunk,
document boundaries ignored, and torch's deprecated differentiable all_gather.
Last, ring attention in bfloat16 with float32 (default) and bfloat16 accumulators,
against float64 on the same values: how far each goes past one bfloat16 rounding.

    torchrun --nproc_per_node=2 tests/workers/context_parallel_check.py
"""

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import worker_checks  # tests/workers/, the script's folder
from worker_checks import mismatch

from ddp_course import context_parallel as cp
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(
    batch_size=2,
    n_heads=12,  # divisible by 2, 3 and 4
    t_local=6,
    head_dim=4,
)

TOL = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {"rtol": 1e-6, "atol": 1e-6}}


def whole(world_size, dtype, batch=None, heads=None):
    gen = torch.Generator().manual_seed(0)
    shape = (
        batch or args.batch_size,
        heads or args.n_heads,
        world_size * args.t_local,
        args.head_dim,
    )
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(4)]  # q, k, v, dO


def documents(world_size):
    """Packed documents of lengths 5, 1, 7, ... cut anywhere by the rank boundaries."""
    t = world_size * args.t_local
    lengths, ids, doc = [5, 1, 7, 3, 9, 2], [], 0
    while len(ids) < t:
        ids += [doc] * lengths[doc % len(lengths)]
        doc += 1
    return torch.tensor(ids[:t])


def compare(
    ctx,
    fn,
    dtype,
    layout="contiguous",
    causal=True,
    docs=None,
    ref_docs="same",
    batch=None,
    heads=None,
    variant="as_written",
    **kw,
):
    """Run fn on this rank's tokens; mismatches of output and q, k, v gradients."""
    ref_docs = docs if ref_docs == "same" else ref_docs
    q, k, v, grad = whole(ctx.world_size, dtype, batch, heads)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = cp.reference_attention(*ref_in, causal=causal, document_ids=ref_docs)
    (ref * grad).sum().backward()

    def mine(x):
        return cp.shard_sequence(x, ctx.rank, ctx.world_size, layout)

    local = [mine(x).clone().requires_grad_() for x in (q, k, v)]
    my_grad = mine(grad)
    if variant != "as_written":
        kw["ops"] = broken(variant)  # only the attention: the sharding above stays right
    out = fn(*local, causal=causal, layout=layout, document_ids=docs, **kw)
    (out * my_grad).sum().backward()
    fails = {"output": mismatch(out, mine(ref), **TOL[dtype])}
    for name, a, b in zip("qkv", local, ref_in):
        fails[f"d{name}"] = mismatch(a.grad, mine(b.grad), **TOL[dtype])
    return fails


def broken(variant):
    """Ring attention's pieces with one of the mistakes the checks must catch."""
    if variant == "merge_without_lse_correction":
        # Each block normalised on its own and the outputs simply added.
        def merge(out_a, lse_a, out_b, lse_b):
            return out_a + out_b, torch.logaddexp(lse_a, lse_b)

        return cp.RingOps(merge=merge)
    if variant == "causal_mask_per_chunk":
        # Every rank believes its chunk starts the sequence: a causal triangle per block.
        return cp.RingOps(segments=lambda r, p, t, lay: cp.sequence_segments(0, p, t, lay))
    raise ValueError(f"no such mistake: {variant!r}")


def counted_forward(ctx, fn, layout="contiguous", dtype=torch.float32):
    """Bytes sent (forward, backward) and block products computed by fn's forward on this rank."""
    q, k, v, grad = whole(ctx.world_size, dtype)
    local = [
        cp.shard_sequence(x, ctx.rank, ctx.world_size, layout).requires_grad_() for x in (q, k, v)
    ]
    sends, work = CollectiveLog(), {"blocks": 0, "pairs": 0, "visible": 0}

    def block(q, k, v, mask):
        work["blocks"] += 1
        work["pairs"] += q.shape[2] * k.shape[2]
        work["visible"] += q.shape[2] * k.shape[2] if mask is None else int(mask.sum())
        return cp.block_attention(q, k, v, mask)

    # Only the ring computes blocks; Ulysses' work stays 0.
    kw = {"ops": cp.RingOps(block=block)} if fn is cp.ring_attention else {}
    with sends.recording("forward"):
        out = fn(*local, causal=True, layout=layout, **kw)
    with sends.recording("backward"):
        (out * cp.shard_sequence(grad, ctx.rank, ctx.world_size, layout)).sum().backward()

    def sent(phase):
        # The ring's passes are sends and receives (a receive sends 0 bytes).
        ops = {"p2p": ("send", "recv"), "all_to_all": ("all_to_all",)}
        return {
            key: sum(c["sent"] for c in sends.calls if c["op"] in kinds and c["phase"] == phase)
            for key, kinds in ops.items()
        }

    return {
        "bytes": sent("forward"),
        "backward_bytes": sent("backward"),
        "work": work,
        "local_shape": list(local[0].shape),
    }


def overlap_events(ctx):
    """The order in which ring attention posts passes, computes blocks and waits (float64)."""
    events, names = [], {0: "kv", 2: "dkv"}

    class LoggedPass(cp.RingPass):
        def __init__(self, tensors, group=None, tag=0):
            events.append(f"post {names[tag]}")
            super().__init__(tensors, group, tag)
            self.tag = tag

        def wait(self):
            received = super().wait()
            events.append(f"wait {names[self.tag]}")
            return received

    def block(*a):
        events.append("block")
        return cp.block_attention(*a)

    def block_backward(*a):
        events.append("block backward")
        return cp.block_attention_backward(*a)

    q, k, v, grad = whole(ctx.world_size, torch.float64)
    local = [cp.shard_sequence(x, ctx.rank, ctx.world_size).requires_grad_() for x in (q, k, v)]
    ops = cp.RingOps(block=block, block_backward=block_backward, ring_pass=LoggedPass)
    out = cp.ring_attention(*local, causal=True, ops=ops)
    (out * cp.shard_sequence(grad, ctx.rank, ctx.world_size)).sum().backward()
    return events


def torch_gather(x, group=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated: the point of the check
        return torch.cat(dist_nn.all_gather(x, group), dim=2)


def ring_bf16(ctx, layout):
    """Ring attention on bfloat16 q, k, v: per accumulator dtype, the most |ours - exact|
    goes past one bfloat16 rounding of the exact value, 2^-8 |exact|, for the output and
    the q, k, v gradients (exact: float64 on the same bfloat16 values)."""
    q, k, v, grad = (x.to(torch.bfloat16).double() for x in whole(ctx.world_size, torch.float64))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = cp.reference_attention(*ref_in, causal=True)
    (ref * grad).sum().backward()

    def mine(x):
        return cp.shard_sequence(x, ctx.rank, ctx.world_size, layout)

    exact = [mine(x) for x in (ref, *(x.grad for x in ref_in))]
    beyond = {}
    for acc, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        local = [mine(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
        out = cp.ring_attention(*local, causal=True, layout=layout, accumulate_dtype=dtype)
        (out.double() * mine(grad)).sum().backward()
        got = [out, *(x.grad for x in local)]
        assert all(g.dtype == torch.bfloat16 for g in got), [g.dtype for g in got]
        beyond[acc] = {
            name: ((a.double() - b).abs() - 2.0**-8 * b.abs()).max().item()
            for name, a, b in zip(["output", "dq", "dk", "dv"], got, exact)
        }
    return beyond


def check(ctx):
    fails, docs = {}, documents(ctx.world_size)
    for dtype in (torch.float64, torch.float32):
        d = str(dtype).removeprefix("torch.")
        for layout in ("contiguous", "zigzag"):
            for name, fn in (
                ("ring", cp.ring_attention),
                ("ulysses", cp.ulysses_attention),
                ("allgather", cp.allgather_attention),
            ):
                fails[f"{name} {layout} causal {d}"] = compare(ctx, fn, dtype, layout)
                fails[f"{name} {layout} documents {d}"] = compare(ctx, fn, dtype, layout, docs=docs)
        fails[f"ring not causal {d}"] = compare(ctx, cp.ring_attention, dtype, causal=False)
    out = {"fails": fails}
    out["mistakes"] = {
        "merge_without_lse_correction": None,
        "causal_mask_per_chunk": None,
        "documents_ignored": compare(
            ctx, cp.ring_attention, torch.float64, docs=None, ref_docs=docs
        ),
        "torch_all_gather b2 h3": compare(
            ctx, cp.allgather_attention, torch.float64, batch=2, heads=3, gather=torch_gather
        ),
        "torch_all_gather b1 h1": compare(
            ctx, cp.allgather_attention, torch.float64, batch=1, heads=1, gather=torch_gather
        ),
        "gather_sequence b2 h3": compare(
            ctx, cp.allgather_attention, torch.float64, batch=2, heads=3
        ),
    }
    for variant in ("merge_without_lse_correction", "causal_mask_per_chunk"):
        out["mistakes"][variant] = compare(ctx, cp.ring_attention, torch.float64, variant=variant)
    out["counted"] = {
        "ring contiguous": counted_forward(ctx, cp.ring_attention),
        "ring zigzag": counted_forward(ctx, cp.ring_attention, "zigzag"),
        "ring bfloat16": counted_forward(ctx, cp.ring_attention, dtype=torch.bfloat16),
        "ulysses": counted_forward(ctx, cp.ulysses_attention),
    }
    out["overlap_events"] = overlap_events(ctx)
    out["schedule_work"] = {
        layout: cp.ring_work(ctx.world_size, args.t_local, layout)[ctx.rank]
        for layout in ("contiguous", "zigzag")
    }
    errors = {}
    q = torch.zeros(1, 5, args.t_local, args.head_dim)  # 5 heads: no world size 2-4 divides it
    for name, call in (
        ("ulysses 5 heads", lambda: cp.ulysses_attention(q, q, q)),
        (
            "ring odd zigzag",
            lambda: cp.ring_attention(q[:, :, :-1], q[:, :, :-1], q[:, :, :-1], layout="zigzag"),
        ),
        ("ring shapes differ", lambda: cp.ring_attention(q, q[:, :1], q)),
    ):
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    out["ring_bf16"] = {layout: ring_bf16(ctx, layout) for layout in ("contiguous", "zigzag")}
    return out


with distributed(device="cpu") as ctx:
    mine = check(ctx)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    write_results(
        ctx, args.results, {"world_size": ctx.world_size, "args": vars(args), "ranks": gathered}
    )
