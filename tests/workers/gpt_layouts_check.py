"""Worker: lesson 13's layouts broken on purpose, each beside the correct one, on 4 ranks.

The correct FSDP x TP layout (2 x 2) trains the tiny TinyGPT in float64 with SGD for a
few steps on the same global batches as one process; then three mistakes run the same
way: the data sliced by the tensor-parallel coordinate instead of the data-parallel one
(mesh dimensions swapped), the loss summed over data-parallel ranks instead of averaged,
and FSDP applied over the tensor-parallel dimension (gradients averaged over ranks that
hold the same data). Then pipeline stages with tensor parallelism (pp 2 x tp 2), whose
loss cannot be vocabulary-parallel (the schedule runs backward outside ``loss_parallel()``;
``MeshModel`` gathers the logits instead): its stage's parameters against one process, and
its second step's collectives against ``expected_collectives``. Also: a mesh built for the
wrong world size, and tensor parallelism over more ranks than heads, must raise ValueError.
The worker records, never asserts in between, so every rank runs the same collectives.

    torchrun --nproc_per_node=4 tests/workers/gpt_layouts_check.py
"""

import warnings

import torch
import worker_checks  # tests/workers/, the script's folder
from torch.distributed.fsdp import fully_shard

from ddp_course import mesh_layouts as ml
from ddp_course import mesh_predictions as predict
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.mesh_model import MeshModel
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.runtime import distributed
from ddp_course.tools.mesh_counts import count_step
from ddp_course.tools.records import write_results

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
args = worker_checks.parse_args(steps=3)

CONFIG = dict(vocab_size=256, d_model=16, n_heads=4, n_layers=2, seq_len=16)
GLOBAL_BATCH, LR, MOMENTUM = 8, 0.5, 0.9


def fresh_model(device):
    torch.manual_seed(0)
    return TinyGPT(**CONFIG).to(device=device, dtype=torch.float64)


def batches(device):
    gen = torch.Generator().manual_seed(1)
    text = shakespeare_bytes("train")
    return [
        [t.to(device) for t in lm_batch(text, GLOBAL_BATCH, CONFIG["seq_len"], gen)]
        for _ in range(args.steps)
    ]


def reference(device, data):
    model = fresh_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in data:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


class FsdpOverTp(MeshModel):
    """The mistake: fully_shard over the ``tp`` dimension (ranks given the same slice)."""

    def __init__(self, model, lay, mesh):
        self.layout, self.mesh, self.loss_parallel = lay, mesh, False
        self.stage_index, self.schedule = 0, None
        for block in model.blocks:
            fully_shard(block, mesh=mesh["tp"])
        self.module = fully_shard(model, mesh=mesh["tp"])
        self.dp_groups = [mesh["shard"].get_group()]


def train(ctx, data, variant):
    lay = ml.layout("fsdp x tp", ctx.world_size)
    mesh = ml.build_mesh(lay, ctx.device.type)
    model = fresh_model(ctx.device)
    mm = FsdpOverTp(model, lay, mesh) if variant == "fsdp over tp" else MeshModel(model, lay, mesh)
    opt = torch.optim.SGD(mm.module.parameters(), lr=LR, momentum=MOMENTUM)
    r = mesh.get_local_rank("tp") if variant == "data by tp coordinate" else ml.data_rank(mesh)
    per = GLOBAL_BATCH // lay.dp
    for x, y in data:
        x, y = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        if variant == "loss summed over dp":
            original = mm.loss_parallel
            mm.loss_parallel = False  # a plain loss times dp: the sum of the ranks' means
            logits = mm.module(x)
            (
                lm_loss(logits.full_tensor() if hasattr(logits, "full_tensor") else logits, y)
                * lay.dp
            ).backward()
            mm.loss_parallel = original
        else:
            mm.forward_backward(x, y)
        opt.step()
        opt.zero_grad()
    return mm.full_parameters()


def pipeline_with_tp(ctx, data, ref):
    """pp 2 x tp 2 (GPipe, 2 micro-batches): this stage's largest gap from one process, its
    parameter names, and the second step's collectives beside the formula."""
    lay = ml.Layout("pp x tp", pp=2, tp=2)
    mm = MeshModel(fresh_model(ctx.device), lay, ml.build_mesh(lay, ctx.device.type))
    opt = torch.optim.SGD(mm.module.parameters(), lr=LR, momentum=MOMENTUM)
    seen = {}
    for step, (x, y) in enumerate(data):
        if step == 1:
            seen = count_step(mm, x, y)[1]
        else:
            mm.forward_backward(x, y)
        opt.step()
        opt.zero_grad()
    params = mm.full_parameters()
    formula = predict.expected_collectives(lay, CONFIG["n_layers"], stage=mm.stage_index)
    return {
        "gap": max((params[n] - ref[n]).abs().max().item() for n in params),
        "names": sorted(params),
        "counts": seen,
        "formula": formula,
    }


def refused(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def main():
    with distributed() as ctx:
        data = batches(ctx.device)
        ref = reference(ctx.device, data)
        start = {n: p.detach() for n, p in fresh_model(ctx.device).named_parameters()}
        gaps = {}
        for variant in (
            "as written",
            "data by tp coordinate",
            "loss summed over dp",
            "fsdp over tp",
        ):
            params = train(ctx, data, variant)
            gaps[variant] = max((params[n] - ref[n]).abs().max().item() for n in ref)
        pipeline = pipeline_with_tp(ctx, data, ref)
        by_rank = [None] * ctx.world_size
        torch.distributed.all_gather_object(by_rank, pipeline)
        errors = {
            "world size": refused(lambda: ml.build_mesh(ml.Layout("x", dp=2), ctx.device.type)),
            "tp > heads": refused(
                lambda: ml.apply_tensor_parallel(
                    TinyGPT(**{**CONFIG, "n_heads": 2}),
                    ml.build_mesh(ml.Layout("t", tp=4), ctx.device.type)["tp"],
                )
            ),
        }
        moved = max((start[n] - ref[n]).abs().max().item() for n in ref)
        write_results(
            ctx,
            args.results,
            {
                "world_size": ctx.world_size,
                "gaps": gaps,
                "moved": moved,
                "errors": errors,
                "pp x tp": by_rank,
                "all_names": sorted(ref),
            },
        )


if __name__ == "__main__":
    main()
