"""Worker: ZeRO stages 1-3 trained with Adam against torch's DDP + Adam, plus broken variants.

Every rank builds the model with its own seed (ZeRO and DDP must broadcast
rank 0's), trains each variant for ``--steps`` steps on the same batches and
reports, from rank 0: the largest parameter gap to DDP, the bytes of state
each rank holds after a step, and the collective volume of one step.

    torchrun --nproc_per_node=2 tests/workers/sharding_equivalence.py --results r.json
"""

import warnings

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.models import MLP
from ddp_course.runtime import distributed
from ddp_course.sharding import FP32_ADAM, ZeRO, state_bytes_per_rank
from ddp_course.tools.records import write_results
from ddp_course.tools.zero_counts import held_bytes

args = worker_checks.parse_args(steps=4, batch_size=4)
# CommDebugMode's module tracker uses full backward hooks, which warn on the first layer.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


class SummedZero(ZeRO):
    """Broken: sums gradients over ranks instead of averaging them."""

    def _reduce_scatter(self, sharded, grad):
        return super()._reduce_scatter(sharded, grad) * self.world_size


class NoGatherZero(ZeRO):
    """Broken: after the step each rank keeps only its own shard up to date."""

    def _all_gather(self, sharded):
        full = sharded.param.detach().reshape(-1).clone()
        full[sharded.start : sharded.end] = sharded.shard.detach()
        return full


class UnloggedZero(ZeRO):
    """Broken bookkeeping: all-gathers happen but are left out of the log."""

    def _all_gather(self, sharded):
        full = super()._all_gather(sharded)
        self.comm.calls.pop()
        return full


class WholeModelZero(ZeRO):
    """Broken: every rank keeps optimizer state for the whole model (plain DDP memory)."""

    def __init__(self, module, optimizer_class, stage, **defaults):
        super().__init__(module, optimizer_class, stage, **defaults)
        self.spare = optimizer_class(list(module.parameters()), **defaults)

    def step(self):
        super().step()
        for p in self.spare.param_groups[0]["params"]:
            for name in ("exp_avg", "exp_avg_sq"):
                self.spare.state[p][name] = torch.zeros_like(p)
        self.optimizer.state.update(self.spare.state)


class KeepGatheredZero(ZeRO):
    """Stage 3 that keeps each layer gathered from its forward until its gradient is reduced.

    Wrong for the memory claim (the whole model is gathered at once), and the
    trade FSDP2's ``reshard_after_forward=False`` makes: one all-gather less.
    """

    def _after_forward(self, module, args, output):
        pass


VARIANTS = {
    "stage1": (ZeRO, 1),
    "stage2": (ZeRO, 2),
    "stage3": (ZeRO, 3),
    "stage1-sum": (SummedZero, 1),
    "stage3-sum": (SummedZero, 3),
    "stage2-no-gather": (NoGatherZero, 2),
    "stage2-unlogged": (UnloggedZero, 2),
    "stage1-whole-optimizer": (WholeModelZero, 1),
    "stage3-no-reshard": (KeepGatheredZero, 3),
}


class Scale(torch.nn.Module):
    """One learnable number: its single element leaves every rank but rank 0 an empty shard."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1) + 0.1 * torch.randn(1))

    def forward(self, x):
        return x * self.scale


def new_model(ctx):
    torch.manual_seed(1000 + ctx.rank)  # different on every rank on purpose
    return torch.nn.Sequential(MLP(in_features=20, hidden=32, num_classes=5), Scale()).to(
        ctx.device
    )


def batches(ctx, n, b):
    gen = torch.Generator().manual_seed(123)
    for _ in range(args.steps):
        x = torch.randn(n * b, 20, generator=gen).to(ctx.device)
        y = torch.randint(0, 5, (n * b,), generator=gen).to(ctx.device)
        mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
        yield x[mine], y[mine]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


with distributed() as ctx:
    n, b = ctx.world_size, args.batch_size
    ddp_volume = []

    def counting_hook(state, bucket):
        ddp_volume[-1] += 2 * bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)

    ddp = DDP(new_model(ctx))
    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for x, y in batches(ctx, n, b):
        ddp_volume.append(0)
        opt.zero_grad()
        loss_of(ddp, x, y).backward()
        opt.step()
    reference = {name: p.detach() for name, p in ddp.module.named_parameters()}
    layer_bytes = [sum(p.nbytes for p in m.parameters(recurse=False)) for m in ddp.module.modules()]
    num_params = sum(p.numel() for p in reference.values())

    out = {
        "world_size": n,
        "num_params": num_params,
        "ddp_volume": ddp_volume[-1],
        "layer_bytes": [b for b in layer_bytes if b],
    }
    for name, (cls, stage) in VARIANTS.items():
        zero = cls(new_model(ctx), torch.optim.Adam, stage, lr=0.01)
        for x, y in batches(ctx, n, b):
            zero.comm.clear()
            # torch's own count of the c10d collectives, to check that ZeRO logs every one
            with CommDebugMode() as torch_count:
                loss_of(zero, x, y).backward()
                zero.step()
            held = held_bytes(zero)  # after the step: gradients and optimizer state alive
            volume = zero.comm.volume_bytes
            logged = [op for op, _ in zero.comm.calls]
            zero.zero_grad()
        full = zero.full_parameters()
        gap = max((full[k] - reference[k]).abs().max().item() for k in reference)
        # This rank's elements, and how many parameter tensors (one Adam step counter each).
        ranges = zero.shard_ranges().values()
        own = sum(end - start for start, end in ranges)
        per_rank = [None] * n
        dist.all_gather_object(
            per_rank,
            {
                "held": held.__dict__,
                "own": own,
                "tensors": len(ranges),
                "empty": sum(start == end for start, end in ranges),
            },
        )
        out[name] = {
            "gap": gap,
            "per_rank": per_rank,
            "volume": volume,
            "peak_gathered": zero.peak_gathered_bytes,
            "logged_calls": logged,
            "torch_counts": {str(k): v for k, v in torch_count.get_comm_counts().items()},
            "ops": sorted({op for op, _ in zero.comm.calls}),
            "formula": state_bytes_per_rank(stage, num_params, n, FP32_ADAM).__dict__,
        }
    try:  # a model that differs across ranks must be refused on every rank
        ZeRO(MLP(in_features=20, hidden=32 + ctx.rank, num_classes=5), torch.optim.Adam, 2)
        out["mismatch_error"] = None
    except ValueError as error:
        out["mismatch_error"] = str(error)
    write_results(ctx, args.results, out)
