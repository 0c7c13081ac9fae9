"""Mixed precision and gradient compression with DDP: bytes sent and accuracy, measured.

Run from the repository root:
    python scripts/07_mixed_precision.py
    torchrun --nproc_per_node=2 scripts/07_mixed_precision.py --epochs 1

The same MLP is trained on the bundled MNIST subset five ways: float32; autocast
(bfloat16 on CPU, float16 with a gradient scaler on GPU); and float32 compute
with the gradients compressed for the all-reduce by torch's communication hooks
(fp16, bf16, PowerSGD of rank 2). Every all-reduce, DDP's own and the hooks',
is counted in bytes, step by step, by the course's collective log: PowerSGD
sends its first steps uncompressed.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.data import load_mnist
from ddp_course.harness.script_args import script_parser
from ddp_course.models import MLP
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results
from ddp_course.training import evaluate

VARIANTS = ("float32", "autocast", "fp16 hook", "bf16 hook", "PowerSGD hook")
POWERSGD_RANK = 2  # matrix_approximation_rank
POWERSGD_START = 2  # start_powerSGD_iter: the steps before it are sent uncompressed


def parse_args():
    meaning = {"epochs": "passes over the training subset"}
    p = script_parser(__doc__, epochs=1, batch_size=32, results=None, help=meaning)
    p.add_argument("--max-steps", type=int, default=0, help="stop each run early (0: no)")
    return p.parse_args()


def wrap(variant, ctx):
    torch.manual_seed(0)
    model = DDP(MLP(784, 256, 2).to(ctx.device))
    group = dist.group.WORLD
    if variant == "fp16 hook":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif variant == "bf16 hook":
        model.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif variant == "PowerSGD hook":
        state = powerSGD_hook.PowerSGDState(
            group,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_START,
            min_compression_rate=1,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    # float32 and autocast: DDP's own all-reduce (its C++ reducer; the log sees it too).
    return model


def train(variant, ctx, args, images, labels):
    model = wrap(variant, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cuda = ctx.device.type == "cuda"
    use_amp = variant == "autocast"
    # float16 needs a gradient scaler against underflow; bfloat16 has float32's range.
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and cuda)
    amp_dtype = torch.float16 if cuda else torch.bfloat16
    n, b = ctx.world_size, args.batch_size
    per_rank = len(images) // n
    mine = torch.arange(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    steps, bytes_by_step, calls = 0, [], 0
    log = CollectiveLog()  # every all-reduce, DDP's own and the hooks'
    for epoch in range(args.epochs):
        order = mine[torch.randperm(per_rank, generator=torch.Generator().manual_seed(epoch))]
        for i in range(per_rank // b):
            idx = order[i * b : (i + 1) * b]
            x, y = images[idx].to(ctx.device), labels[idx].to(ctx.device)
            amp = torch.autocast(ctx.device.type, dtype=amp_dtype) if use_amp else None
            with amp or contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            with log.recording(steps):
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            sent = [c["bytes"] for c in log.calls if c["op"] == "all_reduce"]
            bytes_by_step.append(sum(sent))
            calls += len(sent)
            log.calls.clear()
            steps += 1
            if steps == args.max_steps:
                break
    return model.module, {"steps": steps, "all_reduce_calls": calls,
                          "bytes_per_step": sum(bytes_by_step) / steps,
                          "bytes_by_step": bytes_by_step}


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        images, labels = load_mnist(train=True, source="subset").tensors()
        test_set = load_mnist(train=False, source="subset").dataset
        results = {}
        for variant in VARIANTS:
            module, stats = train(variant, ctx, args, images, labels)
            stats["accuracy"] = evaluate(module, test_set, ctx)["accuracy"]
            results[variant] = stats
            log.info(f"{variant:14s} accuracy {stats['accuracy']:.3f}, "
                     f"{stats['bytes_per_step'] / 1e3:.0f} kB all-reduced per step")
        write_results(ctx, args.results, {"world_size": dist.get_world_size(),
                                          "device": str(ctx.device),
                                          "powersgd": {"rank": POWERSGD_RANK,
                                                       "start_iter": POWERSGD_START},
                                          "variants": results})


if __name__ == "__main__":
    main()
