"""FSDP from scratch as a module wrapper, against one process, ZeRO-3 and FSDP2.

Run from the repository root:
    python scripts/09_fsdp_module.py
    torchrun --nproc_per_node=2 scripts/09_fsdp_module.py

Every rank builds the same MLP (each Linear a unit) and trains it with SGD and with
AdamW on its slice of the same batches, as: one process (each rank alone, on the
whole batch: the reference); ddp_course.fsdp.FSDP, whose parameters are this rank's
shards, with reshard_after_forward True and False and with bfloat16 compute; the
from-scratch ZeRO-3 of ddp_course.sharding (the optimizer's view); and FSDP2's
fully_shard on the same units (bfloat16 with MixedPrecisionPolicy). The float32 runs
must equal the reference, the FSDP runs FSDP2's (assert_close). Each rank reports what
model.parameters() yields and what its optimizer steps, the bytes it holds, the
collectives of the last step as the course's CollectiveLog saw them, FSDP's formula for
them, and the most bytes of full parameters it held at once.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ddp_course.data import synthetic_classification
from ddp_course.fsdp import FSDP
from ddp_course.harness.script_args import script_parser
from ddp_course.models import MLP
from ddp_course.runtime import distributed, get_logger, no_tf32, pick_backend, pick_device
from ddp_course.sharding import ZeRO
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results
from ddp_course.tools.zero_counts import held_bytes

# fully_shard warns that the root's output is a view of the last layer's: harmless here.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.1), "adamw": (torch.optim.AdamW, 1e-3)}
KINDS = ("FSDP", "FSDP reshard_after_forward=False", "FSDP bfloat16", "ZeRO-3",
         "FSDP2", "FSDP2 reshard_after_forward=False", "FSDP2 bfloat16")


def parse_args():
    p = script_parser(__doc__, steps=3, batch_size=16, hidden=128, results=None,
                      help={"steps": "steps per variant and optimizer"})
    return p.parse_args()


def build(kind, optimizer, args, ctx, mesh):
    """The model (every rank the same seed) and its optimizer, wrapped as ``kind`` says."""
    torch.manual_seed(0)
    model = MLP(hidden=args.hidden).to(ctx.device)
    units = [m for m in model.net if isinstance(m, torch.nn.Linear)]
    opt_class, lr = OPTIMIZERS[optimizer]
    if kind == "ZeRO-3":
        zero = ZeRO(model, opt_class, stage=3, lr=lr)
        return zero, zero.optimizer
    if kind.startswith("FSDP2"):
        bf16 = kind.endswith("bfloat16")
        policy = MixedPrecisionPolicy(torch.bfloat16 if bf16 else None, torch.float32)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=not kind.endswith("False"))
        model = fully_shard(model, mesh=mesh, mp_policy=policy)
    elif kind != "one process":
        dtype = torch.bfloat16 if kind.endswith("bfloat16") else None
        model = FSDP(model, units=units, compute_dtype=dtype,
                     reshard_after_forward=not kind.endswith("False"))
    # NEW: an ordinary optimizer over model.parameters(): FSDP's are this rank's shards.
    return model, opt_class(model.parameters(), lr=lr)


def full_parameters(model):
    """Every full parameter by name (all-gathered where sharded: call on every rank)."""
    if isinstance(model, FSDP):
        return model.full_parameters()
    if isinstance(model, ZeRO):
        return model.full_parameters()
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def local_shape(p):
    """The shape of what this rank holds of ``p`` (a DTensor's local shard)."""
    return list(p.to_local().shape if isinstance(p, DTensor) else p.shape)


def train(kind, optimizer, batches, args, ctx, mesh):
    model, opt = build(kind, optimizer, args, ctx, mesh)
    b = 0 if kind == "one process" else args.batch_size  # one process: the whole batch
    log = CollectiveLog()
    for step, (x, y) in enumerate(batches):
        part = slice(ctx.rank * b, (ctx.rank + 1) * b) if b else slice(None)
        stepper = model if kind == "ZeRO-3" else opt  # ZeRO steps its own optimizer
        stepper.zero_grad()  # first: the last step's gradients are counted below
        with log.recording(step):
            F.cross_entropy(model(x[part]).float(), y[part]).backward()
        stepper.step()
    inner = model.module if isinstance(model, (FSDP, ZeRO)) else model
    measured = {
        "params": full_parameters(model),
        "calls": [
            (c["op"], c["bytes"], c["dtype"]) for c in log.calls if c["phase"] == len(batches) - 1
        ],
        "held": held_bytes(model if isinstance(model, ZeRO) else inner, opt).__dict__,
        # What the learner's code sees: model.parameters() and the optimizer's tensors.
        "parameters": [local_shape(p) for p in inner.parameters()],
        "optimizer_steps": [local_shape(p) for g in opt.param_groups for p in g["params"]],
    }
    if isinstance(model, FSDP):
        measured.update(formula=model.step_traffic().__dict__, unit_bytes=model.unit_bytes(),
                        peak=model.peak_gathered_bytes)
    return measured


def gap(a, b):
    """Largest absolute difference between two dicts of tensors (same names)."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def main():
    args = parse_args()
    with distributed(backend=pick_backend(pick_device()), group_of_one=True) as ctx:
        no_tf32()  # float32 compared to float32 rounding, also on a GPU
        log = get_logger(ctx)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        n, b = ctx.world_size, args.batch_size
        x, y = synthetic_classification(args.steps * n * b).tensors
        batches = [(x[i * n * b : (i + 1) * n * b].to(ctx.device),
                    y[i * n * b : (i + 1) * n * b].to(ctx.device))
                   for i in range(args.steps)]
        torch.manual_seed(0)  # the start every variant trains from
        start = {k: v.to(ctx.device) for k, v in MLP(hidden=args.hidden).state_dict().items()}
        results = {"world_size": n, "device": ctx.device.type, "runs": {}}
        for optimizer in OPTIMIZERS:
            ref = train("one process", optimizer, batches, args, ctx, mesh)["params"]
            runs, params = {}, {}
            for kind in KINDS:
                got = runs[kind] = train(kind, optimizer, batches, args, ctx, mesh)
                params[kind] = got.pop("params")
                got["gap"] = gap(params[kind], ref)
                got["moved"] = gap(ref, start)
                if not kind.endswith("bfloat16"):  # the claim: the same training
                    torch.testing.assert_close(params[kind], ref)
                if kind.startswith("FSDP2"):  # and FSDP from scratch the same as FSDP2
                    mine = params[kind.replace("FSDP2", "FSDP")]
                    torch.testing.assert_close(mine, params[kind])
                    runs[kind.replace("FSDP2", "FSDP")]["gap_fsdp2"] = gap(mine, params[kind])
                log.info(f"{optimizer:5s} {kind:34s} |param - one process| {got['gap']:.1e}")
            per_rank = [None] * n
            dist.all_gather_object(per_rank, runs)
            results["runs"][optimizer] = per_rank
        write_results(ctx, args.results, results)


if __name__ == "__main__":
    main()
