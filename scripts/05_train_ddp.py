"""Lesson 05: the lesson 01 script as DistributedDataParallel, in five steps.

    python scripts/05_train_ddp.py --epochs 5                        # one process
    torchrun --nproc_per_node=2 scripts/05_train_ddp.py --epochs 5   # two ranks
    torchrun --nnodes=1 --nproc_per_node=4 scripts/05_train_ddp.py   # four GPUs
    torchrun --nproc_per_node=2 scripts/05_train_ddp.py --optimizer sgd --lr 0.05 \\
        --grad-reduce sum --max-steps 20 --no-dropout --float64  # a deliberately broken DDP

--batch-size is per rank: N ranks with batch b take the same steps as one
process with batch N*b. Each rank uses cuda:<LOCAL_RANK> and nccl when there
are GPUs, else the CPU and gloo. Lines marked NEW are what DDP adds.

Dropout draws different masks on every rank (seed + rank after the model is
built), as the N*b samples of one process's batch would get; the model's
initialisation and the sampler use the same seed everywhere. TF32 is off
(ddp_course.runtime.no_tf32), so float32 runs on a GPU compare to float32
rounding; --float64 runs, which the lesson compares to 1e-9, to float64's.
"""

import os
import sys
import time

import torch
import torch.distributed as dist  # NEW
from torch.nn.parallel import DistributedDataParallel as DDP  # NEW
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler  # NEW

from ddp_course.checkpoint import load_checkpoint, save_checkpoint, unwrap
from ddp_course.data import load_mnist
from ddp_course.models import SmallCNN
from ddp_course.runtime import (
    DistContext,
    distributed,
    get_logger,
    no_tf32,
    rank0_first,
    seed_everything,
)
from ddp_course.tools.records import write_results
from ddp_course.training import TrainConfig, evaluate, train_one_epoch

# What --no-eval reports in place of the test metrics, for runs compared by their weights alone.
NOT_TESTED = {"accuracy": None, "loss": None, "samples": 0}


def allreduce_sum_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A broken DDP on purpose: all-reduce a bucket of gradients WITHOUT dividing
    by the world size, so every gradient is N times too large. (DDP's default,
    torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook,
    divides by N first.)"""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def count_renames_onto(path: str) -> list:
    """A list that grows each time THIS process renames a file onto ``path``,
    as save_checkpoint's os.replace does: which rank wrote the checkpoint."""
    target, renames = os.path.abspath(path), []

    def hook(event, args):  # Python's audit events (PEP 578); os.replace is "os.rename"
        if event == "os.rename" and os.path.abspath(args[1]) == target:
            renames.append(args[1])

    sys.addaudithook(hook)
    return renames


def train(
    ctx: DistContext,
    cfg: TrainConfig,
    optimizer_name: str,
    grad_reduce: str,
    dtype: torch.dtype,
    test: bool = True,
) -> None:
    log = get_logger(ctx)
    seed_everything(cfg.seed)  # the same model initialisation on every rank
    with rank0_first(ctx):  # NEW: one rank downloads, the others wait and then read
        train_set = load_mnist(cfg.data_dir, train=True, source=cfg.data_source)
        test_set = load_mnist(cfg.data_dir, train=False, source=cfg.data_source)
    log.info(f"{train_set.source} MNIST: {len(train_set.dataset)} train, "
             f"{len(test_set.dataset)} test digits")

    # NEW step 3: each rank reads its own 1/N of every epoch's shuffled order.
    sampler = DistributedSampler(train_set.dataset, num_replicas=ctx.world_size,
                                 rank=ctx.rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_set.dataset, batch_size=cfg.batch_size, sampler=sampler)

    model = SmallCNN(dropout=cfg.dropout).to(dtype).to(ctx.device)  # float32 or float64
    if ctx.is_distributed:  # NEW step 4: wrap; gradients are all-reduced in backward
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        if grad_reduce == "sum":
            model.register_comm_hook(state=None, hook=allreduce_sum_hook)
    torch.manual_seed(cfg.seed + ctx.rank)  # NEW: dropout masks differ from rank to rank
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    start_epoch = 0
    if cfg.checkpoint and os.path.exists(cfg.checkpoint):
        start_epoch = load_checkpoint(cfg.checkpoint, model, optimizer, ctx.device)["epoch"]
        log.info(f"resumed from {cfg.checkpoint} at epoch {start_epoch}")
    renames = count_renames_onto(cfg.checkpoint) if cfg.checkpoint else []

    history, start = [], time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)  # NEW: a different shuffle every epoch, the same on all ranks
        stats = train_one_epoch(model, loader, optimizer, ctx, epoch, cfg.max_steps, cfg.progress)
        # NEW: evaluate the plain module, so that evaluation runs no DDP collective.
        metrics = evaluate(unwrap(model), test_set.dataset, ctx) if test else NOT_TESTED
        history.append({"epoch": epoch, "train_loss": stats.loss, "train_samples": stats.samples,
                        "train_seconds": stats.seconds, "test_accuracy": metrics["accuracy"],
                        "test_loss": metrics["loss"]})
        accuracy = f"{metrics['accuracy']:.4f}" if test else "not tested"
        log.info(f"epoch {epoch}: train loss {stats.loss:.4f}, test accuracy {accuracy}, "
                 f"{stats.samples_per_s:,.0f} samples/s")
        if cfg.checkpoint:  # step 5: save_checkpoint writes on rank 0, then all wait
            save_checkpoint(ctx, cfg.checkpoint, model, optimizer, epoch=epoch + 1)

    final = evaluate(unwrap(model), test_set.dataset, ctx) if not history else metrics
    # NEW: every rank's checkpoint writes and a checksum of its weights, gathered
    weights = float(sum(p.detach().double().sum() for p in unwrap(model).parameters()))
    everyone = [(len(renames), weights)]
    if ctx.is_distributed:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, (len(renames), weights))
    train_samples = sum(h["train_samples"] for h in history)
    train_seconds = sum(h["train_seconds"] for h in history)
    write_results(ctx, cfg.results, {
        "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
        "data_source": train_set.source, "epochs": cfg.epochs, "batch_size": cfg.batch_size,
        "lr": cfg.lr, "optimizer": optimizer_name, "grad_reduce": grad_reduce, "dtype": str(dtype),
        "train_loss": history[-1]["train_loss"] if history else None,
        "test_accuracy": final["accuracy"], "test_samples": final["samples"],
        "samples_per_s": train_samples / train_seconds if history else None,
        "checkpoint_writes_per_rank": [w for w, _ in everyone],
        "weights_checksum_per_rank": [c for _, c in everyone],
        "wall_s": time.perf_counter() - start, "history": history,
    })


def main() -> None:
    parser = TrainConfig.parser("Train the small CNN on MNIST with DDP.")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                        help="sgd to check the all-reduce: its step is lr x gradient")
    parser.add_argument("--grad-reduce", choices=["mean", "sum"], default="mean",
                        help="sum: a broken DDP that does not divide by N")
    parser.add_argument("--float64", action="store_true",
                        help="train in float64, for runs compared to float rounding")
    parser.add_argument("--no-eval", dest="test", action="store_false",
                        help="no test-set evaluation after each epoch, for runs compared "
                             "by their weights alone")
    args = vars(parser.parse_args())
    cfg = TrainConfig.from_namespace(args, parser)
    # Full float32 on Ampere+ GPUs (no TF32 convolutions), so that runs of this
    # script compare to float rounding.
    no_tf32()
    # NEW steps 1 and 2: a process group (env:// from torchrun's variables) and
    # this rank's device; the group is destroyed on the way out, even on errors.
    with distributed() as ctx:
        dtype = torch.float64 if args["float64"] else torch.float32
        train(ctx, cfg, args["optimizer"], args["grad_reduce"], dtype, args["test"])


if __name__ == "__main__":
    main()
