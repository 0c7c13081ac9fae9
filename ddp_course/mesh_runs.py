"""TinyGPT trained on a layout, and the one-process runs it must equal (notebook 13).

Every layout of :mod:`ddp_course.mesh_layouts` starts from the same weights
(:func:`new_model`) and sees the same global batches (:func:`global_batches`): each
data-parallel rank takes its slice (:func:`my_slice`). :func:`train` trains a
:class:`~ddp_course.mesh_model.MeshModel`; :func:`one_process` is the reference it is
compared with (:func:`max_gap`). :func:`checkpoint_round_trip` saves a
``torch.distributed.checkpoint`` (DCP) on one mesh and loads it on another and in one
process; :func:`loss_normalisation_lab` shows why padded sequences need the global token
count (:func:`~ddp_course.mesh_model.token_mean_loss`); :func:`sample` writes text with the
trained weights. What these runs count and hold is measured in
:mod:`ddp_course.tools.mesh_counts`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from . import mesh_layouts as ml
from .data import lm_batch, shakespeare_bytes
from .mesh_model import MeshModel, token_mean_loss
from .models import TinyGPT, lm_loss

__all__ = [
    "adamw",
    "checkpoint_round_trip",
    "gather_lists",
    "global_batches",
    "load_checkpoint",
    "loss_normalisation_lab",
    "master_dtypes",
    "max_gap",
    "my_slice",
    "new_model",
    "one_process",
    "padded_batch",
    "plain_step",
    "same_on_every_rank",
    "sample",
    "sgd",
    "train",
]


def new_model(config: dict, dtype: torch.dtype, device, seed: int) -> TinyGPT:
    """A whole TinyGPT of ``config`` (its keyword arguments), the same weights for the
    same ``seed`` on every rank and in every layout (the default generator is seeded)."""
    torch.manual_seed(seed)
    return TinyGPT(**config).to(device=device, dtype=dtype)


def global_batches(
    steps: int, global_batch: int, seq_len: int, seed: int, device, split: str = "train"
) -> list[list[torch.Tensor]]:
    """``steps`` global batches of Shakespeare's ``split`` (``"train"`` or ``"val"``), the
    same on every rank (their own generator, seeded ``seed + 1``): each ``[x, y]``,
    ``int64 [global_batch, seq_len]``, ``y`` the next byte of ``x``."""
    gen = torch.Generator().manual_seed(seed + 1)
    text = shakespeare_bytes(split)
    return [
        [t.to(device) for t in lm_batch(text, global_batch, seq_len, gen)] for _ in range(steps)
    ]


def my_slice(batch, mesh, dp: int) -> list[torch.Tensor]:
    """This rank's sequences of the global batch: its data-parallel index r picks rows
    ``r B/dp`` to ``(r + 1) B/dp - 1`` of each ``[B, T]`` tensor."""
    r, per = ml.data_rank(mesh), batch[0].shape[0] // dp
    return [t[r * per : (r + 1) * per] for t in batch]


def sgd(params, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9: the optimizer the layouts are compared under."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def adamw(params, lr: float) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults: the real run's optimizer and the memory rows'."""
    return torch.optim.AdamW(params, lr=lr)


def plain_step(mm: MeshModel, step: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step's forward and backward, :meth:`MeshModel.forward_backward` on this
    rank's slice ``int64 [B/dp, T]``: :func:`train`'s default ``step_fn``."""
    return mm.forward_backward(x, y)


def train(
    lay: ml.Layout,
    model: TinyGPT,
    batches,
    ctx,
    optimizer: Callable,
    lr: float,
    compute_dtype: torch.dtype | None = None,
    step_fn: Callable = plain_step,
    clock: Callable[[], float] = time.perf_counter,
    val: dict | None = None,
):
    """Train ``model`` laid out as ``lay``, one step per global batch of ``batches``.

    Args:
        lay: the layout; its mesh is built on ``ctx.device``'s type.
        model: a whole TinyGPT, the same weights on every rank (laid out in place).
        batches: global batches ``[x, y]``, ``int64 [B, T]``; each data-parallel rank
            trains on its :func:`my_slice`.
        ctx: this process's :class:`~ddp_course.runtime.DistContext`.
        optimizer: ``optimizer(params, lr)``, e.g. :func:`sgd` or :func:`adamw`.
        lr: its learning rate.
        compute_dtype: mixed precision (see :class:`~ddp_course.mesh_model.MeshModel`).
        step_fn: ``step_fn(mm, step, x, y) -> loss`` runs forward and backward of step
            ``step`` (from 0) on this rank's slice; default :func:`plain_step`.
            (:func:`ddp_course.tools.mesh_counts.counted_step` counts one step's
            collectives.)
        clock: seconds now, read after each step (and after each validation, so the set-up
            before the first step and the validations are not timed).
        val: a dict with ``every`` (steps) and ``batches`` (fixed held-out global batches):
            the validation loss, the mean of :meth:`MeshModel.evaluate` over those batches,
            before the first step, after every ``every`` steps and after the last, is
            appended to ``val["losses"]`` and the steps done to ``val["steps"]``.

    Returns:
        ``(losses, mm, opt, seconds)``: the global mean loss of every step, the
        :class:`~ddp_course.mesh_model.MeshModel`, the optimizer and the seconds of every step.
    """
    mesh = ml.build_mesh(lay, ctx.device.type)
    mm = MeshModel(model, lay, mesh, compute_dtype=compute_dtype)  # a layout, one line
    opt = optimizer(mm.module.parameters(), lr)

    def validate(done):
        if val is not None and (done % val["every"] == 0 or done == len(batches)):
            held_out = [mm.evaluate(*my_slice(b, mesh, lay.dp)) for b in val["batches"]]
            val.setdefault("steps", []).append(done)
            val.setdefault("losses", []).append(statistics.fmean(held_out))
        return clock()  # the next step's clock starts after it

    losses, seconds = [], []
    before = validate(0)
    for step, batch in enumerate(batches):
        losses.append(step_fn(mm, step, *my_slice(batch, mesh, lay.dp)))
        opt.step()
        opt.zero_grad()
        after = clock()
        seconds.append(after - before)
        before = validate(step + 1) if val is not None else after
    return losses, mm, opt, seconds


def one_process(model: TinyGPT, batches, lr: float):
    """The reference: :func:`sgd` on the whole global batch in one process, no layout.

    Returns:
        ``(params, losses)``: the trained parameters by name (detached) and the loss of
        every step.
    """
    opt = sgd(model.parameters(), lr)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def max_gap(params: dict, reference: dict) -> float:
    """Largest ``|params - reference|`` over the parameters named in ``params`` (a
    pipeline stage's: ``reference`` may hold more)."""
    return max((params[n] - reference[n]).abs().max().item() for n in params)


def load_checkpoint(module, opt, folder: str, **kwargs) -> None:
    """Load the DCP checkpoint in ``folder`` into ``module`` and its optimizer ``opt``,
    whatever their layout: ``get_state_dict`` names every entry by the whole model's
    parameter names, ``dcp.load`` fills this rank's shards of them, ``set_state_dict`` puts
    them back. ``kwargs`` go to ``dcp.load`` (``no_dist=True`` in a plain process)."""
    model_sd, optim_sd = get_state_dict(module, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder, **kwargs)
    set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def checkpoint_round_trip(
    ctx, config: dict, dtype: torch.dtype, batches, lr: float, folder: str
) -> dict:
    """Save a DCP checkpoint on the 2 x 2 mesh (FSDP x TP), reload it on 4 x 1 (FSDP) and
    in one process (``no_dist=True``), both starting from other weights; all three take the
    next step.

    Args:
        ctx: this process's context; 4 ranks.
        config, dtype: TinyGPT's arguments and dtype.
        batches: global batches; all but the last train before saving, the last is the
            step after loading.
        lr: :func:`sgd`'s learning rate.
        folder: the checkpoint's folder (overwritten).

    Returns:
        ``{"2x2 (saved)" | "4x1" | "one process": {"loss": the next step's loss,
        "gap": largest |parameter - the 2 x 2 run's| after it}}``.
    """
    *before, after = batches
    lay = ml.layout("fsdp x tp", ctx.world_size)
    _, mm, opt, _ = train(lay, new_model(config, dtype, ctx.device, 0), before, ctx, sgd, lr)
    model_sd, optim_sd = get_state_dict(mm.module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    results = {}
    saved_loss = mm.forward_backward(*my_slice(after, mm.mesh, 2))
    opt.step()
    saved_params = mm.full_parameters()
    results["2x2 (saved)"] = {"loss": saved_loss, "gap": 0.0}

    lay = ml.layout("fsdp", ctx.world_size)
    mesh = ml.build_mesh(lay, ctx.device.type)
    mm4 = MeshModel(new_model(config, dtype, ctx.device, 99), lay, mesh)  # other weights
    opt4 = sgd(mm4.module.parameters(), lr)
    load_checkpoint(mm4.module, opt4, folder)
    loss4 = mm4.forward_backward(*my_slice(after, mesh, 4))
    opt4.step()
    results["4x1"] = {"loss": loss4, "gap": max_gap(mm4.full_parameters(), saved_params)}

    alone = new_model(config, dtype, ctx.device, 99)
    opt1 = sgd(alone.parameters(), lr)
    load_checkpoint(alone, opt1, folder, no_dist=True)
    loss1 = lm_loss(alone(after[0]), after[1])
    loss1.backward()
    opt1.step()
    params1 = {n: p.detach() for n, p in alone.named_parameters()}
    results["one process"] = {"loss": loss1.item(), "gap": max_gap(params1, saved_params)}
    return results


def padded_batch(batch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` with each sequence cut to a random length in ``[2, T]`` (its own generator,
    seeded ``seed``): the inputs unchanged, the targets past the length set to -100."""
    gen = torch.Generator().manual_seed(seed)
    x, y = batch
    lengths = torch.randint(2, x.shape[1] + 1, (x.shape[0],), generator=gen).to(x.device)
    y = y.masked_fill(torch.arange(x.shape[1], device=x.device) >= lengths[:, None], -100)
    return x, y


def loss_normalisation_lab(ctx, config: dict, dtype: torch.dtype, batch) -> dict:
    """Gradients of DDP over every rank on the :func:`padded_batch` of ``batch``, with
    per-rank mean losses and with :func:`~ddp_course.mesh_model.token_mean_loss`, against
    one process on the whole padded batch.

    Returns:
        ``{"tokens_per_rank": [real tokens of each rank's slice], "grad_gap": {way:
        largest |gradient - one process's|}}``.
    """
    x, y = padded_batch(batch, 7)
    alone = new_model(config, dtype, ctx.device, 0)
    # One process: cross_entropy's own mean over the tokens whose target is not -100.
    functional.cross_entropy(alone(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
    reference = {n: p.grad for n, p in alone.named_parameters()}
    per = x.shape[0] // ctx.world_size
    mine = slice(ctx.rank * per, (ctx.rank + 1) * per)
    counts = [(y[r * per : (r + 1) * per] != -100).sum().item() for r in range(ctx.world_size)]
    gaps = {}
    group = dist.group.WORLD  # here DDP's data-parallel group spans every rank
    for way in ("mean of rank means", "global token count"):
        model = DistributedDataParallel(
            new_model(config, dtype, ctx.device, 0), process_group=group
        )
        logits = model(x[mine])
        if way == "mean of rank means":
            loss = functional.cross_entropy(logits.flatten(0, 1), y[mine].flatten())
        else:
            loss = token_mean_loss(logits, y[mine], group)
        loss.backward()
        gaps[way] = max(
            (p.grad - reference[n]).abs().max().item() for n, p in model.module.named_parameters()
        )
    return {"tokens_per_rank": counts, "grad_gap": gaps}


def gather_lists(ctx, value) -> list:
    """Every rank's ``value`` (a picklable object), in rank order, on every rank (a
    collective: every rank calls it)."""
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def same_on_every_rank(ctx, values: list[float], what: str) -> list[float]:
    """``values`` if every rank holds the very same ones (a collective).

    Raises:
        RuntimeError: some rank's differ; the message names ``what`` and shows every rank's.
    """
    seen = gather_lists(ctx, values)
    if any(v != seen[0] for v in seen):
        raise RuntimeError(f"{what} differ across the ranks: {seen}")
    return values


def master_dtypes(module) -> list[str]:
    """The dtypes of the parameters the optimizer updates (a DTensor's is its shard's),
    sorted, e.g. ``["torch.float32"]`` under mixed precision."""
    return sorted({str(p.dtype) for p in module.parameters()})


def sample(
    params: dict, config: dict, dtype: torch.dtype, device, new_bytes: int, seed: int
) -> str:
    """Text from the trained weights, gathered whole (``params`` by name), in one process:
    the prompt ``ROMEO:`` and ``new_bytes`` bytes drawn at temperature 0.8 (a generator
    seeded ``seed`` on ``device``), decoded as ASCII."""
    whole = TinyGPT(**config).to(device=device, dtype=dtype)
    whole.load_state_dict(params)
    prompt = torch.tensor([list(b"ROMEO:")], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    text = whole.generate(prompt, new_bytes, temperature=0.8, generator=gen)
    return bytes(text[0].tolist()).decode("ascii", errors="replace")
