"""What the from-scratch tensor-parallel block runs and keeps, measured on this rank
(``13_tp_from_scratch.py``, notebook 13).

:func:`block_check` runs one :class:`~ddp_course.sequence_parallel.ParallelBlock` forward
and backward against the whole block, with its collectives counted per phase by the
course's :class:`~ddp_course.tools.collective_log.CollectiveLog`;
:func:`ring_bytes_per_rank` is the ring model of those calls. :func:`layernorm_saved_bytes`
and :func:`saved_block_bytes` count what autograd keeps for backward
(:func:`~ddp_course.tools.saved_tensors.saved_activation_bytes`), the second against
:func:`~ddp_course.mesh_predictions.saved_block_bytes_formula`. ``args`` and ``ctx`` as in
:mod:`ddp_course.parallel_gpt_runs`.
"""

from __future__ import annotations

import torch

from .. import sequence_parallel as sp
from ..mesh_predictions import saved_block_bytes_formula
from ..models import Block
from ..parallel_gpt import gather_full_state
from ..parallel_gpt_runs import max_diff, my_part
from .collective_log import CollectiveLog
from .saved_tensors import saved_activation_bytes

__all__ = [
    "block_check",
    "layernorm_saved_bytes",
    "ring_bytes_per_rank",
    "saved_block_bytes",
    "split_block",
]


def block_check(args, ctx, sequence_parallel: bool, tol: float) -> dict:
    """One float64 block, forward and backward of ``((out - 1)^2).sum()``, split over the
    ranks, against the whole block in one process; its collectives per phase.

    Returns:
        ``{"diffs": {"output", "input gradient", "parameter gradients": largest |split -
        whole|}, "calls": {"forward" | "backward" | "after backward": {op: [bytes]}}}``.

    Raises:
        AssertionError: a difference above ``tol``.
    """
    torch.manual_seed(0)
    ref = Block(args.d_model, args.n_heads, flash=False).double().to(ctx.device)
    # Heads and hidden features split over the ranks; with SP also the sequence.
    par = sp.ParallelBlock(ref, ctx.rank, ctx.world_size, sequence_parallel=sequence_parallel)
    par = par.to(ctx.device)  # already there: built from ref's weights
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.seq_len, args.d_model)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(ctx.device).requires_grad_()
    ((ref(x) - 1) ** 2).sum().backward()
    x_par = x.detach().clone().requires_grad_()
    x_in = my_part(x_par, ctx) if sequence_parallel else x_par
    log = CollectiveLog()
    with log.recording("forward"):
        out = par(x_in)
    with log.recording("backward"):
        ((out - 1) ** 2).sum().backward()
    with log.recording("after backward"):
        sp.all_reduce_sequence_parallel_grads(par)  # nothing to do without SP
    part = my_part if sequence_parallel else (lambda t, _: t)
    grads = gather_full_state(par, grads=True)
    diffs = {
        "output": max_diff(out, part(ref(x), ctx), tol),
        "input gradient": max_diff(part(x_par.grad, ctx), part(x.grad, ctx), tol),
        "parameter gradients": max(
            max_diff(grads[n], q.grad, tol) for n, q in ref.named_parameters()
        ),
    }
    return {
        "diffs": diffs,
        "calls": {ph: log.summary(ph) for ph in ("forward", "backward", "after backward")},
    }


def ring_bytes_per_rank(calls: dict, n: int) -> int:
    """The ring model of the counted calls ``{op: [bytes of each]}`` on ``n`` ranks: each
    rank sends 2(N-1)/N K per all-reduce and (N-1)/N K per all-gather or reduce-scatter (a
    model, not a measurement), in bytes."""
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    return sum(factor[op] * (n - 1) * k // n for op, ks in calls.items() for k in ks)


def split_block(args, ctx, seq_par: bool, **block_kwargs):
    """This rank's :class:`~ddp_course.sequence_parallel.ParallelBlock` of a float64
    ``Block(d_model, n_heads, **block_kwargs)`` (seeded 0) and its input, a random
    ``[B, T, d]`` (``[B, T/N, d]``, this rank's positions, with sequence parallelism) that
    requires a gradient."""
    torch.manual_seed(0)
    whole = Block(args.d_model, args.n_heads, **block_kwargs).double()
    par = sp.ParallelBlock(whole, ctx.rank, ctx.world_size, sequence_parallel=seq_par)
    par = par.to(ctx.device)
    x = torch.randn(
        args.batch_size, args.seq_len, args.d_model, dtype=torch.float64, device=ctx.device
    )
    return par, (my_part(x, ctx) if seq_par else x).requires_grad_()


def layernorm_saved_bytes(args, ctx, seq_par: bool) -> int:
    """Bytes the two LayerNorms of one float64 block (no dropout) save for backward on
    this rank: their input ``[B, T, d]`` (``[B, T/N, d]`` with sequence parallelism) and
    their mean and reciprocal standard deviation."""
    par, x = split_block(args, ctx, seq_par)
    out = {}
    with saved_activation_bytes([par.ln1, par.ln2], out):
        par(x).sum().backward()
    return out["bytes"]


def saved_block_bytes(args, ctx, seq_par: bool) -> dict:
    """Bytes one whole block (dropout 0.1, explicit attention) saves for backward here.

    Returns:
        ``{"bytes": counted, "formula": saved_block_bytes_formula's, "whole [B, T, d]
        kept": how many saved tensors have the whole [B, T, d] (or [B T, d]) shape}``.
    """
    par, x = split_block(args, ctx, seq_par, dropout=0.1, flash=False)
    out = {}
    with saved_activation_bytes([par], out):
        y = par(x)
    y.sum().backward()
    whole_shape = [
        [args.batch_size, args.seq_len, args.d_model],
        [args.batch_size * args.seq_len, args.d_model],
    ]
    # CUDA's fused dropout keeps a 1-byte mask; the CPU's a float64 one.
    mask = 1 if ctx.device.type == "cuda" else 8
    formula = saved_block_bytes_formula(
        args.batch_size, args.seq_len, args.d_model, args.n_heads, ctx.world_size, seq_par, 8, mask
    )
    return {
        "bytes": out["bytes"],
        "formula": formula,
        "whole [B, T, d] kept": sum(s in whole_shape for s in out["shapes"]),
    }
