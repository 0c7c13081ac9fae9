"""Lesson 11: fault-tolerant training that resumes from a snapshot after a restart.

Run from the repository root:
    python scripts/11_train.py --epochs 2 --checkpoint build/11/snapshot.pt
    torchrun --nproc_per_node=2 scripts/11_train.py --epochs 2 --checkpoint build/11/snapshot.pt
    torchrun --nproc_per_node=2 --max-restarts=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 scripts/11_train.py --epochs 2 \\
        --checkpoint build/11/killed.pt --die-at-step 70 --die-rank 1

The snapshot (model, optimizer, epoch, step, RNG states, the sampler's epoch
and the world sizes seen) is written atomically by rank 0 at every epoch end
and every --checkpoint-every steps; a start that finds one resumes from it. With
--die-at-step K --die-rank R, rank R kills itself with SIGKILL before global
step K, on the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so torchrun's
--max-restarts has something deterministic to restart. Each rank also prints
who it is (global, local and group rank) and, at the end, the peers its TCP
sockets talk to. Rank 0 writes --results as JSON.
"""

import argparse
import hashlib
import os
import signal
import socket
import time

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_course.checkpoint import (
    load_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
    unwrap,
)
from ddp_course.data import MNIST_MEAN, MNIST_STD, load_mnist
from ddp_course.harness.script_args import script_parser
from ddp_course.models import MLP
from ddp_course.runtime import DistContext, distributed, get_logger, seed_everything
from ddp_course.tools.records import write_results
from ddp_course.training import evaluate


def parse_args() -> argparse.Namespace:
    meaning = {"epochs": "passes over the 4,000 digits", "lr": "SGD learning rate (momentum 0.9)"}
    p = script_parser(__doc__, epochs=2, batch_size=32, lr=0.05, seed=0, checkpoint=None,
                      results=None, help=meaning)
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save every N steps (0: at epoch ends only)")
    p.add_argument("--die-at-step", type=int, help="global step at which --die-rank is killed")
    p.add_argument("--max-steps", type=int, help="stop each epoch after this many steps (tests)")
    p.add_argument("--die-rank", type=int, default=0, help="rank that --die-at-step kills")
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds of sleep per step (a slow job a second node can join)",
    )
    p.add_argument(
        "--wait-for-world",
        type=int,
        default=0,
        help="after each epoch, wait up to 60 s while the world is smaller than N"
        " (a long job that a node joins midway)",
    )
    args = p.parse_args()
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be 0 (epoch ends only) or positive")
    return args


def restart_count() -> int:
    """How many times torchrun restarted the workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def who_am_i(ctx: DistContext) -> dict:
    """This rank's place in the job, as torchrun's variables say, and its device and backend."""
    return {
        "rank": ctx.rank, "local_rank": ctx.local_rank,
        "group_rank": int(os.environ.get("GROUP_RANK", "0")),  # the node's rank
        "world_size": ctx.world_size, "local_world_size": ctx.local_world_size,
        "host": socket.gethostname(), "pid": os.getpid(), "restart_count": restart_count(),
        "device": str(ctx.device), "backend": ctx.backend,
    }


def peer_addresses() -> list[str]:
    """Remote IPv4 addresses of this process's established TCP connections: gloo's
    full mesh to the other ranks, and the store."""
    conns = psutil.Process().net_connections(kind="tcp4")
    return sorted({c.raddr.ip for c in conns if c.raddr and c.status == psutil.CONN_ESTABLISHED})


def gather(ctx: DistContext, value) -> list:
    """``value`` of every rank, in rank order (a list of one without a group)."""
    if not ctx.is_distributed:
        return [value]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def digits(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The bundled MNIST split in memory, normalised as torchvision's transform does:
    images float32 [n, 1, 28, 28], labels int64 [n]."""
    mnist = load_mnist(train=train).dataset
    return ((mnist.data.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1), mnist.targets


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes in order: equal digests, equal parameters."""
    h = hashlib.sha256()
    for p in unwrap(model).parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(ctx: DistContext, args: argparse.Namespace) -> None:
    log = get_logger(ctx)
    me = who_am_i(ctx)
    # One write per line: every rank of a node shares the job's output, and print's
    # separate newline let two ranks' lines run together.
    print(f"global rank {me['rank']}, local rank {me['local_rank']}, group rank "
          f"{me['group_rank']}, world size {me['world_size']}, restart count "
          f"{me['restart_count']}\n", end="", flush=True)
    ranks = gather(ctx, me)

    seed_everything(args.seed)
    x, y = digits(train=True)
    test_set = TensorDataset(*digits(train=False))
    model = MLP(hidden=128).to(ctx.device)
    if ctx.is_distributed:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(range(len(y)), num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=True, seed=args.seed)
    steps_per_epoch = -(-sampler.num_samples // args.batch_size)
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)

    # Resume: everything that decides the next step comes from the snapshot.
    epoch, step, loss_sum, seen, world_sizes, resumed_from = 0, 0, 0.0, 0, [], None
    if args.checkpoint and os.path.exists(args.checkpoint):
        snap = load_checkpoint(args.checkpoint, model, optimizer, map_location=ctx.device)
        epoch, step = snap["epoch"], snap["step"]
        world_sizes = list(snap["world_sizes"])
        # The snapshot holds the job's running sums: rank 0 carries them on, the other
        # ranks start from zero, so the epoch's all-reduce counts every sample once.
        loss_sum, seen = (snap["loss_sum"], snap["samples"]) if ctx.is_main else (0.0, 0)
        restore_rng_states(snap["rng"])
        if snap["world_size"] != ctx.world_size and step > 0:
            # Another world size shards the epoch differently: redo it whole.
            log.info(f"world size {snap['world_size']} -> {ctx.world_size}: epoch {epoch} "
                     "starts again")
            step, loss_sum, seen = 0, 0.0, 0
        resumed_from = {"epoch": epoch, "step": step}
        log.info(f"resumed from the snapshot at epoch {epoch}, step {step}")
    world_sizes.append(ctx.world_size)

    def snapshot(next_epoch: int, next_step: int) -> None:
        if args.checkpoint:
            # Every rank's running loss, not only the saving rank's (nccl: on the GPU).
            sums = torch.tensor([loss_sum, seen], dtype=torch.float64, device=ctx.device)
            if ctx.is_distributed:
                dist.all_reduce(sums)
            save_checkpoint(ctx, args.checkpoint, model, optimizer, epoch=next_epoch,
                            step=next_step, loss_sum=sums[0].item(), samples=int(sums[1]),
                            sampler_epoch=sampler.epoch, world_size=ctx.world_size,
                            world_sizes=world_sizes, rng=rng_states())

    loss_fn, history, start = nn.CrossEntropyLoss(), [], time.perf_counter()
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        model.train()
        for s in range(step, steps_per_epoch):
            global_step = epoch * steps_per_epoch + s
            if (args.die_at_step == global_step and ctx.rank == args.die_rank
                    and restart_count() == 0):
                print(f"rank {ctx.rank}: SIGKILL at step {global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            idx = order[s * args.batch_size : (s + 1) * args.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx].to(ctx.device)), y[idx].to(ctx.device))
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(idx)
            seen += len(idx)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.checkpoint_every and (global_step + 1) % args.checkpoint_every == 0:
                snapshot(epoch, s + 1)
        total = torch.tensor([loss_sum, seen], dtype=torch.float64, device=ctx.device)  # nccl: GPU
        if ctx.is_distributed:
            dist.all_reduce(total)
        acc = evaluate(unwrap(model), test_set, ctx)["accuracy"]
        history.append({"epoch": epoch, "train_loss": (total[0] / total[1]).item(),
                        "test_accuracy": acc})
        log.info(f"epoch {epoch}: train loss {history[-1]['train_loss']:.4f}, "
                 f"test accuracy {acc:.4f}")
        epoch, step, loss_sum, seen = epoch + 1, 0, 0.0, 0
        snapshot(epoch, 0)
        if ctx.world_size < args.wait_for_world and epoch < args.epochs:
            # torchrun's agent stops these workers when a node joins, and the
            # next round resumes from the snapshot just written.
            log.info(f"world size {ctx.world_size}: waiting for more nodes")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.1)

    peers = gather(ctx, peer_addresses())
    final = evaluate(unwrap(model), test_set, ctx)
    write_results(ctx, args.results, {
        "world_size": ctx.world_size, "backend": ctx.backend, "epochs": args.epochs,
        "epochs_done": epoch, "steps_per_epoch": steps_per_epoch,
        "restart_count": restart_count(), "resumed_from": resumed_from,
        "world_sizes": world_sizes, "ranks": ranks, "peers": peers,
        "test_accuracy": final["accuracy"], "test_loss": final["loss"],
        "parameters_sha256": parameter_digest(model),
        "parameters_sum": sum(p.double().sum().item() for p in unwrap(model).parameters()),
        "history": history, "wall_s": time.perf_counter() - start,
    })


def main() -> None:
    args = parse_args()
    with distributed() as ctx:
        train(ctx, args)


if __name__ == "__main__":
    main()
