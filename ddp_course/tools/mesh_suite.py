"""Every layout of TinyGPT against one process, on 4 ranks (``13_gpt.py --suite``, notebook 13).

:func:`every_layout` trains each layout of :data:`ddp_course.mesh_layouts.LAYOUTS` from the
same weights on the same global batches (:mod:`ddp_course.mesh_runs`) and measures, on this
rank, how far its parameters are from one process's, the collectives of its second step
(:func:`~ddp_course.tools.mesh_counts.counted_step`) and the bytes it holds
(:func:`~ddp_course.tools.mesh_counts.memory_row`), each beside its formula
(:mod:`ddp_course.mesh_predictions`). :func:`suite` adds the DCP checkpoint round trip and
the padded-loss lab, and gathers what each rank saw.
"""

from __future__ import annotations

import torch

from .. import mesh_layouts as ml
from .. import mesh_predictions as predict
from .. import mesh_runs as runs
from .mesh_counts import count_kept_gathered, counted_step, memory_row

__all__ = ["SUITE_LR", "every_layout", "suite"]

SUITE_LR = 0.5  # SGD: large enough that 5 steps move every weight, so equality means something


def every_layout(ctx, config: dict, dtype: torch.dtype, batches, log) -> dict:
    """Train every layout on ``batches`` with :func:`~ddp_course.mesh_runs.sgd` and compare.

    Args:
        ctx: this process's context (4 ranks: every layout's size).
        config, dtype: TinyGPT's arguments and dtype (float64: the layouts then differ
            from one process only in the order of their sums).
        batches: global batches; all but the last train, the last is the memory rows' step.
        log: a logger; one line per layout.

    Returns:
        ``{"rows": [{"layout", "pp", "dp", "tp", "losses", "gap": largest |parameter - one
        process's| over this rank's parameters, "names": those parameters, "moved": largest
        |parameter - its start|}], "memory": [memory_row per layout], "counts": {layout:
        {"measured", "formula"}}, "reference_losses", "all_names"}``.
    """
    train_batches = batches[:-1]
    first = runs.new_model(config, dtype, ctx.device, 0)
    start = {n: p.detach().clone() for n, p in first.named_parameters()}
    model = runs.new_model(config, dtype, ctx.device, 0)
    reference, reference_losses = runs.one_process(model, train_batches, SUITE_LR)
    rows, memory, counts = [], [], {}
    for name in ml.LAYOUTS:
        lay = ml.layout(name, ctx.world_size)
        model = runs.new_model(config, dtype, ctx.device, 0)
        seen = {}
        losses, mm, *_ = runs.train(
            lay, model, train_batches, ctx, runs.sgd, SUITE_LR, step_fn=counted_step(seen)
        )
        formula = predict.expected_collectives(lay, config["n_layers"])
        counts[name] = {"measured": seen, "formula": formula}
        params = mm.full_parameters()
        rows.append(
            {
                "layout": name,
                "pp": lay.pp,
                "dp": lay.dp,
                "tp": lay.tp,
                "losses": losses,
                "gap": runs.max_gap(params, reference),
                "names": sorted(params),
                "moved": runs.max_gap(params, start),
            }
        )
        memory.append(memory_row(lay, mm, ctx, config, dtype, batches[-1], SUITE_LR))
        log.info(f"{name:>10}: |params - one process| <= {rows[-1]['gap']:.1e}")
    return {
        "rows": rows,
        "memory": memory,
        "reference_losses": reference_losses,
        "all_names": sorted(reference),
        "counts": counts,
    }


def suite(ctx, config: dict, dtype: torch.dtype, steps: int, seed: int, folder: str, log) -> dict:
    """:func:`every_layout` on ``steps`` global batches of 8 sequences, then
    :func:`~ddp_course.tools.mesh_counts.count_kept_gathered`,
    :func:`~ddp_course.mesh_runs.checkpoint_round_trip` (saved in ``folder``) and
    :func:`~ddp_course.mesh_runs.loss_normalisation_lab`; every rank's gaps, parameter
    names, memory rows and counts gathered (a collective: every rank calls it).

    Returns:
        :func:`every_layout`'s keys (``memory``: every rank's rows) and
        ``counts_kept_gathered``, ``checkpoint``, ``loss_lab``, ``gaps_by_rank``,
        ``names_by_rank``, ``counts_by_rank`` (lists in rank order) and ``config``.
    """
    batch_size = 8  # global sequences: divisible by every layout's dp
    batches = runs.global_batches(steps + 1, batch_size, config["seq_len"], seed, ctx.device)
    result = every_layout(ctx, config, dtype, batches, log)
    result["counts_kept_gathered"] = count_kept_gathered(ctx, config, dtype, batches[0])
    result["checkpoint"] = runs.checkpoint_round_trip(ctx, config, dtype, batches, SUITE_LR, folder)
    result["loss_lab"] = runs.loss_normalisation_lab(ctx, config, dtype, batches[0])
    rows = result["rows"]
    result["memory"] = sum(runs.gather_lists(ctx, result["memory"]), [])
    result["gaps_by_rank"] = runs.gather_lists(ctx, {r["layout"]: r["gap"] for r in rows})
    result["names_by_rank"] = runs.gather_lists(ctx, {r["layout"]: r["names"] for r in rows})
    result["counts_by_rank"] = runs.gather_lists(
        ctx, {name: c["measured"] for name, c in result["counts"].items()}
    )
    result["config"] = config
    return result
