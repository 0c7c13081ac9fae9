"""Lesson 06: what DistributedSampler gives each rank, exact evaluation, seeds.

    python scripts/06_samplers.py                  # one rank: every index, no padding
    torchrun --nproc_per_node=3 scripts/06_samplers.py --dataset-size 10 --epochs 3
    torchrun --nproc_per_node=3 scripts/06_samplers.py --checkpoint ../build/06_model.pt \
        --results ../build/06_samplers.json

Each rank builds its own DistributedSampler: no communication, the same
seed gives every rank the same permutation. Each rank records the indices
it reads, without and with set_epoch; evaluates the test digits through a
padded DistributedSampler and with ddp_course.training.evaluate; and records
what its random number generators draw under two seeding schemes. Rank 0
gathers it all (all_gather_object) and writes it to --results. TF32 is off
(ddp_course.runtime.no_tf32), so a GPU evaluates in full float32.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms

from ddp_course.checkpoint import load_checkpoint
from ddp_course.data import load_mnist
from ddp_course.harness.script_args import script_parser
from ddp_course.models import SmallCNN
from ddp_course.runtime import DistContext, distributed, get_logger, no_tf32, seed_everything
from ddp_course.tools.records import write_results
from ddp_course.training import evaluate


def parse_args():
    meaning = {
        "epochs": "epochs in the index demo",
        "batch_size": "evaluation batch per rank",
        "checkpoint": "model to evaluate (default: seeded initialisation)",
    }
    parser = script_parser(
        __doc__, epochs=3, seed=0, batch_size=100, checkpoint=None, results=None, help=meaning
    )
    parser.add_argument("--dataset-size", type=int, default=10, help="samples in the index demo")
    parser.add_argument("--eval-size", type=int, default=0, help="test digits (0: all)")
    parser.add_argument("--data-dir", default="data", help="folder for full MNIST")
    parser.add_argument("--data-source", default="subset", choices=["auto", "full", "subset"])
    return parser.parse_args()


def gather(ctx: DistContext, obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (pickled, any type)."""
    if not ctx.is_distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def sampler_indices(ctx: DistContext, size: int, epochs: int, seed: int) -> dict:
    sampler = DistributedSampler(
        range(size), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed
    )
    forgot = [list(sampler) for _ in range(epochs)]  # the bug: no set_epoch
    fixed = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # NEW: a new permutation every epoch
        fixed.append(list(sampler))
    return {"without_set_epoch": forgot, "with_set_epoch": fixed}


@torch.no_grad()
def padded_evaluate(model: nn.Module, dataset, ctx: DistContext, batch_size: int) -> dict:
    """The usual mistake: evaluate through a DistributedSampler, which pads."""
    model.eval()
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    flags = []
    for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
        flags += (model(x.to(ctx.device)).argmax(1).cpu() == y).int().tolist()
    return {"indices": list(sampler), "correct": flags}


def draws(seed: int) -> dict:
    """What dropout and a random crop draw from the default generator after ``seed``."""
    torch.manual_seed(seed)
    mask = (nn.functional.dropout(torch.ones(12), p=0.5) > 0).int().tolist()
    crops = [
        transforms.RandomCrop.get_params(torch.zeros(1, 28, 28), (24, 24))[:2] for _ in range(3)
    ]
    return {"dropout_mask": mask, "crop_offsets": crops}


def seeding(ctx: DistContext, seed: int) -> dict:
    def init_checksum(model: nn.Module) -> float:
        return float(sum(p.detach().double().sum() for p in model.parameters()))

    seed_everything(seed)  # right: the same seed on every rank for the model
    same = init_checksum(SmallCNN().to(ctx.device))
    seed_everything(seed + ctx.rank)  # wrong for the model
    model = SmallCNN().to(ctx.device)
    per_rank = init_checksum(model)
    after_ddp = mask_after_ddp = None
    if ctx.is_distributed:
        # DDP's constructor broadcasts rank 0's parameters, hiding the mistake
        # for the weights (not for anything else drawn from the generator).
        ddp = nn.parallel.DistributedDataParallel(model)
        after_ddp = init_checksum(ddp.module)
        mask_after_ddp = (nn.functional.dropout(torch.ones(12), p=0.5) > 0).int().tolist()
        del ddp
    return {
        "init_same_seed": same,
        "init_seed_plus_rank": per_rank,
        "init_seed_plus_rank_after_ddp": after_ddp,
        "mask_after_ddp": mask_after_ddp,  # the generator, after the broadcast
        "same_seed": draws(seed),  # every rank draws the same masks and crops
        "seed_plus_rank": draws(seed + ctx.rank),  # every rank draws its own
    }


def main() -> None:
    args = parse_args()
    no_tf32()  # full float32 on a GPU: evaluations are compared with one process's
    with distributed() as ctx:
        log = get_logger(ctx)
        indices = gather(ctx, sampler_indices(ctx, args.dataset_size, args.epochs, args.seed))
        for name in ("without_set_epoch", "with_set_epoch"):
            log.info(f"{name}:")
            for epoch in range(args.epochs):
                row = "  ".join(f"rank {r}: {idx[name][epoch]}" for r, idx in enumerate(indices))
                log.info(f"  epoch {epoch}  {row}")

        seed_everything(args.seed)
        model = SmallCNN().to(ctx.device)
        if args.checkpoint:
            load_checkpoint(args.checkpoint, model, map_location=ctx.device)
        test = load_mnist(args.data_dir, train=False, source=args.data_source).dataset
        if args.eval_size:
            test = Subset(test, range(args.eval_size))
        padded = gather(ctx, padded_evaluate(model, test, ctx, args.batch_size))
        exact = evaluate(model, test, ctx, args.batch_size)
        correct = sum(sum(p["correct"]) for p in padded)
        samples = sum(len(p["correct"]) for p in padded)
        log.info(f"padded DistributedSampler: {correct}/{samples} = {correct / samples:.4f}")
        log.info(
            f"training.evaluate (no padding): {exact['accuracy'] * exact['samples']:.0f}/"
            f"{exact['samples']} = {exact['accuracy']:.4f}"
        )

        seeds = gather(ctx, seeding(ctx, args.seed))
        write_results(
            ctx,
            args.results,
            {
                "world_size": ctx.world_size,
                "device": str(ctx.device),
                "dataset_size": args.dataset_size,
                "epochs": args.epochs,
                "seed": args.seed,
                "indices": indices,
                "eval_size": len(test),
                "padded": padded,
                "exact": exact,
                "seeds": seeds,
            },
        )


if __name__ == "__main__":
    main()
