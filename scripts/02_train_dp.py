"""Lesson 02: train the small CNN with data parallelism inside one process.

    python scripts/02_train_dp.py --epochs 1                  # CPU: 2 threads, from scratch
    python scripts/02_train_dp.py --epochs 5                  # GPUs: nn.DataParallel, all GPUs
    python scripts/02_train_dp.py --impl scratch --replicas 4 --results build/02.json
    DDP_COURSE_DEVICE=cpu python scripts/02_train_dp.py       # CPU threads on a GPU machine
    torchrun --nproc_per_node=1 scripts/02_train_dp.py        # works; more processes are refused

One process drives every replica, so there is nothing for torchrun to
parallelise. Each replica gets a GPU of its own when there are enough GPUs
(cuda:0 .. cuda:n-1), and the model goes into torch.nn.DataParallel;
otherwise every replica runs as a CPU thread in ddp_course.data_parallel.DataParallel,
the same algorithm (torch's wrapper only calls the model on a CPU). A GPU is
never shared by two replicas. --impl torch with too few GPUs stops with a
message naming --impl scratch. The memory reported is the CUDA allocator's
peak per GPU (torch.cuda.max_memory_allocated), or the process's RSS on a CPU.
"""

import dataclasses
import os
import statistics

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_course import data_parallel, runtime
from ddp_course.checkpoint import load_checkpoint, save_checkpoint
from ddp_course.data import load_mnist
from ddp_course.models import SmallCNN
from ddp_course.replica_plan import ReplicaPlan, plan_replicas
from ddp_course.runtime import distributed, get_logger, seed_everything
from ddp_course.tools.monitor import memory_bytes
from ddp_course.tools.records import write_results
from ddp_course.training import TrainConfig, evaluate, train_one_epoch


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


def replica_plan(impl: str, replicas: int | None, device: torch.device) -> ReplicaPlan:
    """Implementation and devices: one GPU per replica, or CPU threads.

    ``device`` is where the launcher's plan puts this process; ``cpu`` there
    (``DDP_COURSE_DEVICE=cpu``) means no GPU is used. Exits with a message
    when ``--impl torch`` cannot give every replica a GPU of its own.
    """
    gpus = runtime.gpu_count() if device.type == "cuda" else 0
    try:
        return plan_replicas(impl, replicas, gpus)
    except ValueError as error:
        raise SystemExit(f"--impl {impl}: {error}") from None


def wrap(model: nn.Module, plan: ReplicaPlan) -> nn.Module:
    if plan.impl == "torch":
        return nn.DataParallel(model, device_ids=[d.index for d in plan.devices])
    return data_parallel.DataParallel(model, devices=plan.devices)


def memory_used(devices: list[torch.device]) -> dict:
    """Bytes: the CUDA allocator's peak per GPU, or this process's RSS on a CPU (one
    number: the replicas are threads of one process)."""
    if devices[0].type == "cuda":
        bytes_ = {str(d): memory_bytes(d) for d in devices}
        return {"kind": "cuda max_memory_allocated", "bytes": bytes_}
    return {"kind": "process RSS at the end", "bytes": {"process": memory_bytes(devices[0])}}


def main() -> None:
    cfg, replicas, impl = parse_args()
    with distributed() as ctx:
        log = get_logger(ctx)
        if ctx.world_size > 1:
            raise SystemExit(
                "DataParallel runs in one process; for several processes "
                "use scripts/05_train_ddp.py (DDP)."
            )
        plan = replica_plan(impl, replicas, ctx.device)  # NEW: a device per replica
        # Models and batches go to the replicas' first device (the CPU when the
        # replicas are threads), which may differ from the process's default.
        ctx = dataclasses.replace(ctx, device=plan.devices[0])
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
        model = wrap(base, plan)  # NEW: the one-line change
        devices = [str(d) for d in plan.devices]
        log.info(
            f"{type(model).__module__}.{type(model).__name__} over {devices} "
            f"({plan.reason}); {train_set.source} MNIST, batch {cfg.batch_size} "
            "split across replicas"
        )

        steps: list[dict[str, float]] = []
        starts: list[float] = []  # when each training forward pass began (seconds)

        def record(module, _inputs):
            if not module.training:
                return
            starts.append(data_parallel.clock(plan.devices))
            # A training forward pass starts after the previous step's backward
            # pass, so module.timings then holds a whole step, "reduce" included.
            if "reduce" in getattr(module, "timings", {}):
                steps.append(dict(module.timings))

        model.register_forward_pre_hook(record)
        history, start = [], data_parallel.clock(plan.devices)
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
        memory = memory_used(plan.devices)
        log.info(
            f"memory ({memory['kind']}): "
            + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in memory["bytes"].items())
        )
        write_results(
            ctx,
            cfg.results,
            {
                "impl": type(model).__module__ + "." + type(model).__name__,
                "devices": devices,
                "device_reason": plan.reason,
                "data_source": train_set.source,
                "batch_size": cfg.batch_size,
                "history": history,
                "step_seconds": parts,
                # From one training forward to the next: a whole step, loading included.
                "step_wall_s": [b - a for a, b in zip(starts, starts[1:], strict=False)],
                "test_accuracy": history[-1]["test_accuracy"] if history else None,
                "memory": memory,
                "wall_s": data_parallel.clock(plan.devices) - start,
            },
        )


if __name__ == "__main__":
    main()
