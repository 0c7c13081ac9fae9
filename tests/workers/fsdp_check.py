"""Worker: ``ddp_course.fsdp.FSDP`` against one process and FSDP2's ``fully_shard``.

Every rank builds the same small float64 model (a root with an input layer of 7 rows,
padded to 4 + 3, and an output layer of 1 row, empty on rank 1; two blocks as units) and
trains it for ``--steps`` steps, each rank on its slice of the same batches, with SGD and
with AdamW, in these variants:

- ``reshard``/``keep``: ``reshard_after_forward`` True / False, float64;
- ``bf16``: compute dtype bfloat16 (master weights float64);
- ``frozen``: a block and the input layer's weight frozen;
- ``tied``: both blocks' Linear share one weight, everything in the root unit.

Each is compared with one process: the whole batch in float64; for ``bf16`` the same
casts (bfloat16 weights and inputs, each rank's slice of the batch on its own, its
gradient cast up before the average), and also the uncast one (how far bfloat16 moves
the result). ``reshard``, ``keep`` and ``bf16`` also run with ``fully_shard`` on the same
units (``MixedPrecisionPolicy(bfloat16, reduce_dtype=float64)`` for ``bf16``). The last
step's collectives are logged (``CollectiveLog``) for both, the first step's shard
gradients compared with the reference's rows. Tying across units must be refused.

    torchrun --nproc_per_node=2 tests/workers/fsdp_check.py
"""

import copy
import warnings

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from worker_checks import mismatch

from ddp_course.fsdp import FSDP
from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

args = worker_checks.parse_args(steps=5)

BATCH = 8  # the global batch; each rank takes BATCH / N rows
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
}
VARIANTS = ("reshard", "keep", "bf16", "frozen", "tied")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 7), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(7, 1)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def build(variant):
    torch.manual_seed(0)
    net = Net().double()
    if variant == "frozen":
        net.blocks[0].requires_grad_(False)
        net.inp.weight.requires_grad_(False)
    if variant == "tied":
        net.blocks[1][0].weight = net.blocks[0][0].weight
    return net


def units(net, variant):
    return [] if variant == "tied" else list(net.blocks)


def batches():
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 6, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 1, generator=gen, dtype=torch.float64),
        )
        for _ in range(args.steps)
    ]


def loss_fn(out, y):
    return (out.double() - y).square().mean()


def trainable(net):
    return [p for p in net.parameters() if p.requires_grad]


def reference(variant, optimizer, n, same_casts):
    """One process; with same_casts, bfloat16 exactly as the ranks compute it."""
    net = build(variant)
    opt = OPTIMIZERS[optimizer](trainable(net))
    first_grads = None
    for x, y in batches():
        if same_casts:
            total = [torch.zeros_like(p) for p in trainable(net)]
            for xr, yr in zip(x.chunk(n), y.chunk(n)):
                low = copy.deepcopy(net).to(torch.bfloat16)
                loss_fn(low(xr.to(torch.bfloat16)), yr).backward()
                for t, p in zip(total, trainable(low)):
                    t += p.grad.double()
            for p, t in zip(trainable(net), total):
                p.grad = t / n
        else:
            loss_fn(net(x), y).backward()
        if first_grads is None:
            first_grads = {k: p.grad.clone() for k, p in net.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
    return {k: p.detach() for k, p in net.named_parameters()}, first_grads


def train(model, ctx, optimizer, full_params):
    """args.steps steps on this rank's slices; the last step's collectives logged."""
    opt = OPTIMIZERS[optimizer](trainable(model))
    log, first = CollectiveLog(), None
    b = BATCH // ctx.world_size
    for step, (x, y) in enumerate(batches()):
        with log.recording(f"step {step}"):
            loss_fn(
                model(x[ctx.rank * b : (ctx.rank + 1) * b]), y[ctx.rank * b : (ctx.rank + 1) * b]
            ).backward()
        if first is None:
            first = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    last = [
        (c["op"], c["bytes"], c["dtype"])
        for c in log.calls
        if c["phase"] == f"step {args.steps - 1}"
    ]
    return full_params(model), first, last


def fsdp2(variant, mesh):
    net = build(variant)
    policy = MixedPrecisionPolicy()
    if variant == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float64)
    for unit in units(net, variant):
        fully_shard(unit, mesh=mesh, reshard_after_forward=variant != "keep", mp_policy=policy)
    return fully_shard(net, mesh=mesh, mp_policy=policy)  # the root: FSDP2's default


def fsdp2_full(model):
    return {k: p.full_tensor().detach() for k, p in model.named_parameters()}


def gap(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def run_variant(ctx, variant, optimizer, mesh):
    n = ctx.world_size
    net = build(variant)
    model = FSDP(
        net,
        units=units(net, variant),
        reshard_after_forward=variant != "keep",
        compute_dtype=torch.bfloat16 if variant == "bf16" else None,
    )
    ours, first, last = train(model, ctx, optimizer, lambda m: m.full_parameters())
    want, want_grads = reference(variant, optimizer, n, same_casts=variant == "bf16")
    start = {k: p.detach() for k, p in build(variant).named_parameters()}
    ranges = model.row_ranges()
    grads = {}  # every shard gradient: its shape, dtype, and its rows of the reference's
    for name, g in first.items():
        key = name.removeprefix("module.")
        lo, hi = ranges[key]
        grads[key] = {
            "shape": list(g.shape),
            "dtype": str(g.dtype),
            "want_shape": [hi - lo, *want_grads[key].shape[1:]],
            "off": mismatch(g, want_grads[key][lo:hi], rtol=0, atol=1e-12),
        }
    traffic = model.step_traffic()
    out = {
        "gap": gap({k.removeprefix("module."): v for k, v in ours.items()}, want),
        "moved": gap(want, start),
        "grads": grads,
        "frozen_grads": [
            k for k, p in model.named_parameters() if not p.requires_grad and p.grad is not None
        ],
        "calls": last,
        "formula": traffic.__dict__,
        "peak": model.peak_gathered_bytes,
        "unit_bytes": model.unit_bytes(),
        "left_gathered": model.gathered_bytes(),
    }
    if variant == "bf16":
        uncast, _ = reference(variant, optimizer, n, same_casts=False)
        out["gap_uncast"] = gap({k.removeprefix("module."): v for k, v in ours.items()}, uncast)
    if variant in ("reshard", "keep", "bf16"):
        theirs, _, their_last = train(fsdp2(variant, mesh), ctx, optimizer, fsdp2_full)
        out["gap_fsdp2"] = gap({k.removeprefix("module."): v for k, v in ours.items()}, theirs)
        out["fsdp2_calls"] = their_last
    return out


def tied_across_units_error():
    net = build("tied")
    try:
        FSDP(net, units=list(net.blocks))
    except ValueError as e:
        return str(e)
    return None


with distributed(device="cpu") as ctx:
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    mine = {f"{v} {o}": run_variant(ctx, v, o, mesh) for v in VARIANTS for o in OPTIMIZERS}
    mine["tied_across_units"] = tied_across_units_error()
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    write_results(ctx, args.results, {"world_size": ctx.world_size, "ranks": everyone})
