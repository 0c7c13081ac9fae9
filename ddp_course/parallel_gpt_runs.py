"""The from-scratch tensor-parallel TinyGPT trained against one process, and its labs
(``13_tp_from_scratch.py``, notebook 13).

Every rank builds the same whole TinyGPT in float64 (:func:`whole_gpt`) and keeps its part
of it as a :class:`~ddp_course.parallel_gpt.ParallelGPT` (tensor parallelism, optionally
sequence parallelism); :func:`train` takes SGD steps on one batch of Shakespeare
(:func:`text_batch`), :func:`reference_training` the same steps in one process.
:func:`block_formula` says which collectives one block runs (Shoeybi et al. 2019;
Korthikanti et al. 2022). Three labs show what must agree across the ranks and what must
not: :func:`seed_lab` (replicated parameters built from per-rank seeds), :func:`dropout_lab`
(dropout masks under three seedings) and :func:`ln_grad_lab` (sequence-parallel LayerNorm
gradients never all-reduced). What the runs count and keep is measured in
:mod:`ddp_course.tools.parallel_gpt_counts`.

Functions take ``args``, an object with the script's flags as attributes: ``d_model``,
``n_heads``, ``n_layers``, ``seq_len``, ``batch_size`` (B, not split), ``steps`` and ``lr``
(SGD), and ``ctx``, this process's :class:`~ddp_course.runtime.DistContext`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import sequence_parallel as sp
from . import tensor_parallel as tp
from .data import lm_batch, shakespeare_bytes
from .models import TinyGPT, lm_loss
from .parallel_gpt import ParallelGPT, gather_full_state

__all__ = [
    "block_formula",
    "dropout_lab",
    "ln_grad_lab",
    "max_diff",
    "my_part",
    "reference_training",
    "seed_lab",
    "spread_across_ranks",
    "text_batch",
    "train",
    "whole_gpt",
]


def whole_gpt(args, device, seed: int = 0, dropout: float = 0.0) -> TinyGPT:
    """The whole float64 TinyGPT of ``args`` (explicit attention), the same weights on every
    rank for the same ``seed`` (the default generator is seeded)."""
    torch.manual_seed(seed)
    model = TinyGPT(
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
        seq_len=args.seq_len,
        dropout=dropout,
        flash=False,
    )
    return model.double().to(device)


def max_diff(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """Largest ``|a - b|``, after ``torch.testing.assert_close`` with ``rtol = atol = tol``
    (AssertionError if they differ by more)."""
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return (a - b).abs().max().item()


def my_part(x: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's positions of ``[B, T, ...]``: the ``rank``-th of ``world_size`` equal
    chunks along T (sequence parallelism's shard)."""
    return x.chunk(ctx.world_size, dim=1)[ctx.rank]


def block_formula(args, n: int, sequence_parallel: bool) -> dict:
    """Collectives of one block per phase, ``{op: [bytes of the whole tensor]}``, on ``n``
    ranks, from the papers; ``K = B T d 8`` bytes is one float64 ``[B, T, d]``.

    Without sequence parallelism (Shoeybi et al. 2019, section 3): g twice in forward, f
    twice in backward, all-reduces of K. With it (Korthikanti et al. 2022, section 4.2.2):
    g and g-bar twice each way, and in backward the inputs of q/k/v and fc1 gathered again
    (only this rank's shard was saved); after backward, one all-reduce of the 6 d replicated
    parameters acting on sequence shards (2 LayerNorms, 2 biases). One rank: none.
    """
    k = args.batch_size * args.seq_len * args.d_model * 8
    if n == 1:
        return {"forward": {}, "backward": {}, "after backward": {}}
    if not sequence_parallel:
        return {
            "forward": {"all_reduce": [k, k]},
            "backward": {"all_reduce": [k, k]},
            "after backward": {},
        }
    return {
        "forward": {"all_gather": [k, k], "reduce_scatter": [k, k]},
        "backward": {"all_gather": [k] * 4, "reduce_scatter": [k, k]},
        "after backward": {"all_reduce": [6 * args.d_model * 8]},
    }


def text_batch(args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch of Shakespeare on every rank: ``int64 [B, T]`` inputs and targets
    (their own generator, seeded 2)."""
    gen = torch.Generator().manual_seed(2)
    tokens = shakespeare_bytes("train").to(device)
    x, y = lm_batch(tokens, args.batch_size, args.seq_len, gen)
    return x.to(device), y.to(device)


def train(
    args,
    ctx,
    sequence_parallel: bool,
    model_seed: int = 0,
    reduce_sp_grads: bool = True,
    recording: Callable | None = None,
):
    """``args.steps`` SGD steps of a :class:`ParallelGPT` on :func:`text_batch`.

    Args:
        sequence_parallel: shard the LayerNorm and dropout regions along T too.
        model_seed: :func:`whole_gpt`'s seed.
        reduce_sp_grads: all-reduce the sequence-parallel parameters' gradients after
            backward (``False``: the mistake of :func:`ln_grad_lab`).
        recording: ``recording(name)``, a context manager each step's forward and backward
            run in (``"step 0"``, ``"step 1"``...), e.g. ``CollectiveLog.recording``.

    Returns:
        ``(full, losses, par)``: the parameters gathered whole by name, the loss of every
        step and the model.
    """
    par = ParallelGPT(
        whole_gpt(args, ctx.device, model_seed),
        ctx.rank,
        ctx.world_size,
        sequence_parallel=sequence_parallel,
    )
    opt = torch.optim.SGD(par.parameters(), lr=args.lr)
    x, y = text_batch(args, ctx.device)
    losses = []
    for step in range(args.steps):
        with recording(f"step {step}") if recording else contextlib.nullcontext():
            loss = lm_loss(par(x), y)
            loss.backward()
            if reduce_sp_grads:
                sp.all_reduce_sequence_parallel_grads(par)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return gather_full_state(par), losses, par


def reference_training(args, device) -> dict[str, torch.Tensor]:
    """The same steps as :func:`train` in one process, on the whole model: its parameters."""
    ref = whole_gpt(args, device)
    opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    x, y = text_batch(args, device)
    for _ in range(args.steps):
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: q.detach() for n, q in ref.named_parameters()}


def spread_across_ranks(par, names: list[str]) -> dict[str, float]:
    """Largest difference between the ranks' copies of each replicated parameter named in
    ``names`` (one all-gather each: every rank calls it)."""
    out = {}
    params = dict(par.named_parameters())
    for name in names:
        copies = [torch.empty_like(params[name]) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, params[name].detach().contiguous())
        out[name] = max((c - copies[0]).abs().max().item() for c in copies)
    return out


def seed_lab(args, ctx) -> dict:
    """Each rank builds its model with seed ``rank`` ("seed + rank") or 0 ("same seed"),
    then keeps its part. The replicated parameters (embeddings, a LayerNorm, the head):
    each rank's largest difference from the one-process model (gathered: rank 0's is 0
    either way) and the largest spread across the ranks."""
    labs = {}
    replicated = ["tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight", "head.weight"]
    for case, seed in (("seed + rank", ctx.rank), ("same seed", 0)):
        par = ParallelGPT(whole_gpt(args, ctx.device, seed), ctx.rank, ctx.world_size)
        one = dict(whole_gpt(args, ctx.device, 0).named_parameters())
        mine = dict(par.named_parameters())
        by_rank = [None] * ctx.world_size
        gap = max((mine[k] - one[k]).abs().max().item() for k in replicated)
        dist.all_gather_object(by_rank, gap)
        labs[case] = {
            "replicated vs one process, by rank": by_rank,
            "replicated spread across ranks": max(spread_across_ranks(par, replicated).values()),
        }
    return labs


def dropout_lab(args, ctx, seed: int = 7) -> list[dict]:
    """Dropout masks of ParallelGPT (dropout 0.5) on every rank, two steps, three ways of
    seeding the sharded regions: one seed for every rank, a per-rank seed drawn again from
    its start each step, and :class:`~ddp_course.tensor_parallel.ParallelRNG`.

    Returns:
        One row per seeding, layout (TP, TP+SP) and region: ``{"seeding", "layout",
        "region", "equal on every rank", "same mask next step"}``.
    """
    ways = {
        "one seed for every rank": lambda: tp.ParallelRNG(seed, rank=0),
        "per-rank seed, seeded again each step": lambda: tp.ParallelRNG(seed, ctx.rank),
        "ParallelRNG (per-rank state, kept)": lambda: tp.ParallelRNG(seed, ctx.rank),
    }
    out = {}
    for way, new_rng in ways.items():
        for layout, seq_par in (("TP", False), ("TP+SP", True)):
            # The weights and the default generator: equal everywhere.
            whole = whole_gpt(args, ctx.device, seed, dropout=0.5)
            par = ParallelGPT(
                whole, ctx.rank, ctx.world_size, sequence_parallel=seq_par, rng=new_rng()
            )
            x, y = text_batch(args, ctx.device)
            steps = []
            for _ in range(2):
                if way.startswith("per-rank seed"):
                    par.rng.states.clear()  # region_seed's state from its start again
                with sp.dropout_masks() as masks:
                    lm_loss(par(x), y).backward()
                steps.append(masks)
            residual = "sequence shard" if seq_par else "replicated residual"
            names = ["replicated embeddings", *["heads", residual, residual] * args.n_layers]
            for i, region in enumerate(names):
                row = out.setdefault((way, layout, region), [True, False])
                for masks in steps:
                    copies = [torch.empty_like(masks[i]) for _ in range(ctx.world_size)]
                    dist.all_gather(copies, masks[i])
                    row[0] &= all(torch.equal(c, copies[0]) for c in copies)
                row[1] |= torch.equal(steps[0][i], steps[1][i])
    return [
        {
            "seeding": w,
            "layout": lay,
            "region": r,
            "equal on every rank": eq,
            "same mask next step": again,
        }
        for (w, lay, r), (eq, again) in out.items()
    ]


def ln_grad_lab(args, ctx, reference: dict[str, torch.Tensor]) -> dict:
    """Sequence parallelism trained without and with the all-reduce of the LayerNorm (and
    bias) gradients: the largest spread of their copies across the ranks and the largest
    difference of the gathered model from ``reference`` (:func:`reference_training`)."""
    lab = {}
    names = ["blocks.0.ln1.weight", "blocks.0.ln2.bias", "blocks.0.mlp.fc2.bias"]
    for case, reduce in (("not reduced", False), ("all-reduced", True)):
        full, _, par = train(args, ctx, True, reduce_sp_grads=reduce)
        drift = max((full[k] - q).abs().max().item() for k, q in reference.items())
        spread = max(spread_across_ranks(par, names).values())
        lab[case] = {"spread across ranks": spread, "max diff from one process": drift}
    return lab
