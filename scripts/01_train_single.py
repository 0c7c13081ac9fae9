"""Lesson 01: train the small CNN on MNIST in one process.

    python scripts/01_train_single.py --epochs 5
    python scripts/01_train_single.py --epochs 1 --results build/01.json

On a machine with a GPU it trains on cuda:0; otherwise on the CPU.
"""

import os
import time

import torch
from torch.utils.data import DataLoader

from ddp_course.checkpoint import load_checkpoint, save_checkpoint
from ddp_course.data import load_mnist
from ddp_course.models import SmallCNN
from ddp_course.runtime import DistContext, get_logger, pick_device, seed_everything
from ddp_course.tools.records import write_results
from ddp_course.training import TrainConfig, evaluate, train_one_epoch


def train(ctx: DistContext, cfg: TrainConfig) -> None:
    log = get_logger(ctx)
    seed_everything(cfg.seed)  # the same model initialisation on every run
    train_set = load_mnist(cfg.data_dir, train=True, source=cfg.data_source)
    test_set = load_mnist(cfg.data_dir, train=False, source=cfg.data_source)
    log.info(f"{train_set.source} MNIST: {len(train_set.dataset)} train, "
             f"{len(test_set.dataset)} test digits")

    shuffle = torch.Generator().manual_seed(cfg.seed)
    loader = DataLoader(train_set.dataset, batch_size=cfg.batch_size, shuffle=True,
                        generator=shuffle)

    model = SmallCNN(dropout=cfg.dropout).to(ctx.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    start_epoch = 0
    if cfg.checkpoint and os.path.exists(cfg.checkpoint):
        start_epoch = load_checkpoint(cfg.checkpoint, model, optimizer, ctx.device)["epoch"]
        log.info(f"resumed from {cfg.checkpoint} at epoch {start_epoch}")

    history, start = [], time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        stats = train_one_epoch(model, loader, optimizer, ctx, epoch, cfg.max_steps, cfg.progress)
        metrics = evaluate(model, test_set.dataset, ctx)
        history.append({"epoch": epoch, "train_loss": stats.loss, "train_samples": stats.samples,
                        "train_seconds": stats.seconds, "test_accuracy": metrics["accuracy"],
                        "test_loss": metrics["loss"]})
        log.info(f"epoch {epoch}: train loss {stats.loss:.4f}, test accuracy "
                 f"{metrics['accuracy']:.4f}, {stats.samples_per_s:,.0f} samples/s")
        if cfg.checkpoint:
            save_checkpoint(ctx, cfg.checkpoint, model, optimizer, epoch=epoch + 1)

    final = evaluate(model, test_set.dataset, ctx) if not history else metrics
    train_samples = sum(h["train_samples"] for h in history)
    train_seconds = sum(h["train_seconds"] for h in history)
    write_results(ctx, cfg.results, {
        "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
        "data_source": train_set.source, "epochs": cfg.epochs, "batch_size": cfg.batch_size,
        "lr": cfg.lr, "train_loss": history[-1]["train_loss"] if history else None,
        "test_accuracy": final["accuracy"], "test_samples": final["samples"],
        "samples_per_s": train_samples / train_seconds if history else None,
        "wall_s": time.perf_counter() - start, "history": history,
    })


def main() -> None:
    cfg = TrainConfig.from_args(description="Train the small CNN on MNIST in one process.")
    train(DistContext(device=pick_device()), cfg)


if __name__ == "__main__":
    main()
