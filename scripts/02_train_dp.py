"""Lesson 02: train the small CNN with data parallelism inside one process.

    python scripts/02_train_dp.py --epochs 1                  # CPU: 2 threads, from scratch
    python scripts/02_train_dp.py --epochs 5                  # GPUs: nn.DataParallel, all GPUs
    python scripts/02_train_dp.py --impl scratch --replicas 4 --results build/02.json
    torchrun --nproc_per_node=1 scripts/02_train_dp.py        # works; more processes are refused

One process drives every replica, so there is nothing for torchrun to
parallelise. With GPUs the model goes into torch.nn.DataParallel; on a CPU,
where that wrapper just calls the model, into ddp_course.parallel.DataParallel,
the same algorithm over worker threads.
"""

import os
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_course import parallel
from ddp_course.checkpoint import load_checkpoint, save_checkpoint
from ddp_course.data import load_mnist
from ddp_course.engine import TrainConfig, evaluate, train_one_epoch, write_results
from ddp_course.models import SmallCNN
from ddp_course.runtime import distributed, get_logger, seed_everything


def parse_args():
    parser = TrainConfig.parser("Train the small CNN with DataParallel in one process.")
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="replicas: GPUs to use, or CPU threads (default: all GPUs, or 2)",
    )
    parser.add_argument(
        "--impl",
        choices=["auto", "torch", "scratch"],
        default="auto",
        help="torch.nn.DataParallel (needs GPUs), ddp_course's from-scratch "
        "version, or auto: torch with GPUs, scratch on a CPU",
    )
    args = vars(parser.parse_args())
    replicas, impl = args.pop("replicas"), args.pop("impl")
    cfg = TrainConfig(**args)
    for name in ("epochs", "batch_size", "lr"):
        if getattr(cfg, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if replicas is not None and replicas < 1:
        parser.error("--replicas must be at least 1")
    return cfg, replicas, impl


def wrap(model: nn.Module, impl: str, replicas: int | None) -> nn.Module:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if impl == "auto":
        impl = "torch" if gpus else "scratch"
    if impl == "torch":
        if not gpus:
            raise SystemExit(
                "--impl torch needs GPUs: on a CPU nn.DataParallel only calls "
                "the model. Use --impl scratch."
            )
        return nn.DataParallel(model, device_ids=list(range(replicas or gpus)))
    return parallel.DataParallel(model, num_replicas=replicas)


def main() -> None:
    cfg, replicas, impl = parse_args()
    with distributed() as ctx:
        log = get_logger(ctx)
        if ctx.world_size > 1:
            raise SystemExit(
                "DataParallel runs in one process; for several processes "
                "use scripts/05_train_ddp.py (DDP)."
            )
        seed_everything(cfg.seed)
        train_set = load_mnist(cfg.data_dir, train=True, source=cfg.data_source)
        test_set = load_mnist(cfg.data_dir, train=False, source=cfg.data_source)
        shuffle = torch.Generator().manual_seed(cfg.seed)
        loader = DataLoader(
            train_set.dataset, batch_size=cfg.batch_size, shuffle=True, generator=shuffle
        )

        base = SmallCNN(dropout=cfg.dropout).to(ctx.device)
        optimizer = torch.optim.Adam(base.parameters(), lr=cfg.lr)
        start_epoch = 0
        if cfg.checkpoint and os.path.exists(cfg.checkpoint):
            # Load into the plain model, before wrapping: no "module." prefix.
            start_epoch = load_checkpoint(cfg.checkpoint, base, optimizer, ctx.device)["epoch"]
            log.info(f"resumed from {cfg.checkpoint} at epoch {start_epoch}")
        model = wrap(base, impl, replicas)  # NEW: the one-line change
        if isinstance(model, parallel.DataParallel):
            devices = [str(d) for d in model.devices]
        else:
            devices = [f"cuda:{i}" for i in model.device_ids]
        log.info(
            f"{type(model).__module__}.{type(model).__name__} over {devices}; "
            f"{train_set.source} MNIST, batch {cfg.batch_size} split across replicas"
        )

        steps: list[dict[str, float]] = []
        starts: list[float] = []  # when each training forward pass began (seconds)

        def record(module, _inputs):
            if not module.training:
                return
            starts.append(time.perf_counter())
            # A training forward pass starts after the previous step's backward
            # pass, so module.timings then holds a whole step, "reduce" included.
            if "reduce" in getattr(module, "timings", {}):
                steps.append(dict(module.timings))

        model.register_forward_pre_hook(record)
        history, start = [], time.perf_counter()
        for epoch in range(start_epoch, cfg.epochs):
            stats = train_one_epoch(
                model, loader, optimizer, ctx, epoch, cfg.max_steps, cfg.progress
            )
            metrics = evaluate(model, test_set.dataset, ctx)
            history.append(
                {
                    "epoch": epoch,
                    "train_loss": stats.loss,
                    "samples_per_s": stats.samples_per_s,
                    "seconds": stats.seconds,
                    "samples": stats.samples,
                    "test_accuracy": metrics["accuracy"],
                }
            )
            log.info(
                f"epoch {epoch}: train loss {stats.loss:.4f}, test accuracy "
                f"{metrics['accuracy']:.4f}, {stats.samples_per_s:,.0f} samples/s"
            )
            if cfg.checkpoint:
                save_checkpoint(ctx, cfg.checkpoint, model, optimizer, epoch=epoch + 1)

        # Median seconds per step of each part of the from-scratch version.
        parts = {k: statistics.median(s[k] for s in steps) for k in steps[0]} if steps else {}
        if parts:
            log.info(
                "median per step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in parts.items())
            )
        write_results(
            ctx,
            cfg.results,
            {
                "impl": type(model).__module__ + "." + type(model).__name__,
                "devices": devices,
                "data_source": train_set.source,
                "batch_size": cfg.batch_size,
                "history": history,
                "step_seconds": parts,
                # From one training forward to the next: a whole step, loading included.
                "step_wall_s": [b - a for a, b in zip(starts, starts[1:], strict=False)],
                "test_accuracy": history[-1]["test_accuracy"] if history else None,
                "wall_s": time.perf_counter() - start,
            },
        )


if __name__ == "__main__":
    main()
