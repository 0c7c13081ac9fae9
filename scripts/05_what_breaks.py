"""Lesson 05: what breaks "N ranks x batch b = one process x batch N*b".

    python scripts/05_what_breaks.py        # one rank: nothing can break
    torchrun --nproc_per_node=2 scripts/05_what_breaks.py --steps 3

For every case, each rank trains a DDP model on its share of the data, then
a plain copy of the same model on the whole global batch (what one process
with batch N*b does), both with plain SGD on the rank's device (TF32 off), and
rank 0 reports the largest difference between their parameters. The cases:

  equal shares       rank r takes b of the N*b samples: the claim holds
  batchnorm          BatchNorm normalises with each rank's own batch statistics
  uneven batches     ranks take b-(N-1) and b+1 samples: DDP averages the ranks'
                     mean losses, which weighs the samples unequally
  padded duplicates  N*b*steps-1 samples through DistributedSampler, which
                     repeats a sample so that every rank gets b
  dropout, seed+rank every rank draws its own dropout masks (lesson 05's choice)
  dropout, same seed every rank draws the same masks
"""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ddp_course.data import synthetic_classification
from ddp_course.harness.script_args import script_parser
from ddp_course.runtime import DistContext, distributed, get_logger, no_tf32
from ddp_course.tools.records import write_results
from ddp_course.training import parameter_gap

CASES = ["equal shares", "batchnorm", "uneven batches", "padded duplicates",
         "dropout, seed+rank", "dropout, same seed"]
FEATURES, HIDDEN, CLASSES = 20, 32, 5


def make_model(case: str) -> nn.Module:
    layers = [nn.Linear(FEATURES, HIDDEN)]
    if case == "batchnorm":
        layers.append(nn.BatchNorm1d(HIDDEN))
    layers.append(nn.ReLU())
    if case.startswith("dropout"):
        layers.append(nn.Dropout(0.5))
    return nn.Sequential(*layers, nn.Linear(HIDDEN, CLASSES))


def shares(case: str, ctx: DistContext, b: int, steps: int) -> tuple[list, list, int]:
    """Per step: this rank's sample indices and the global batch's; and the data size."""
    n, r = ctx.world_size, ctx.rank
    size = n * b * steps - (1 if case == "padded duplicates" else 0)
    glob = [list(range(k * n * b, min((k + 1) * n * b, size))) for k in range(steps)]
    if case == "padded duplicates":  # the real sampler, which pads by repeating
        idx = list(DistributedSampler(range(size), num_replicas=n, rank=r, shuffle=False))
        return [idx[k * b : (k + 1) * b] for k in range(steps)], glob, size
    sizes = [b] * n
    if case == "uneven batches":
        sizes = [b - (n - 1)] + [b + 1] * (n - 1)
    start = sum(sizes[:r])
    return [g[start : start + sizes[r]] for g in glob], glob, size


def sgd_steps(model: nn.Module, data, batches: list, lr: float, ctx: DistContext) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for idx in batches:
        x, y = data.tensors[0][idx].to(ctx.device), data.tensors[1][idx].to(ctx.device)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def run_case(case: str, ctx: DistContext, b: int, steps: int, lr: float, seed: int) -> dict:
    mine, glob, size = shares(case, ctx, b, steps)
    data = synthetic_classification(size, (FEATURES,), num_classes=CLASSES, seed=seed)
    torch.manual_seed(seed)  # the same initialisation everywhere
    model = make_model(case).to(ctx.device)
    initial = make_model(case).to(ctx.device)
    initial.load_state_dict(model.state_dict())
    reference = make_model(case).to(ctx.device)
    reference.load_state_dict(model.state_dict())
    ddp = model
    if ctx.is_distributed:
        ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    torch.manual_seed(seed + (ctx.rank if case == "dropout, seed+rank" else 0))
    sgd_steps(ddp, data, mine, lr, ctx)
    torch.manual_seed(seed)  # one process: its own dropout masks from the seed
    sgd_steps(reference, data, glob, lr, ctx)
    return {"gap": parameter_gap(reference, model), "moved": parameter_gap(reference, initial),
            "rank_samples": sum(map(len, mine)), "global_samples": sum(map(len, glob))}


def main() -> None:
    meaning = {"steps": "SGD steps per case", "lr": "SGD learning rate"}
    parser = script_parser(
        __doc__, batch_size=4, steps=3, lr=0.5, seed=0, results=None, help=meaning
    )
    args = parser.parse_args()
    no_tf32()  # full float32 on a GPU: "equal shares" is compared to float rounding
    with distributed() as ctx:  # the launcher's device plan: a GPU per rank, or the CPU
        if args.batch_size < ctx.world_size:
            parser.error(f"--batch-size must be at least the world size {ctx.world_size}")
        log = get_logger(ctx)
        cases = {c: run_case(c, ctx, args.batch_size, args.steps, args.lr, args.seed)
                 for c in CASES}
        for case, r in cases.items():
            log.info(f"{case:>20}: largest difference from one process {r['gap']:.1e}")
        summary = {"world_size": ctx.world_size, "steps": args.steps,
                   "batch_size": args.batch_size, "cases": cases}
        write_results(ctx, args.results, summary)


if __name__ == "__main__":
    main()
