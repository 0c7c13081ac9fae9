"""Per-rank metrics of a DDP job, with one slow rank: find the straggler.

Run from the repository root:
    python scripts/12_monitor.py
    torchrun --nproc_per_node=2 scripts/12_monitor.py --tb-dir build/12_tb
    torchrun --nproc_per_node=2 scripts/12_monitor.py --sleep-s 0   # no straggler

Every rank trains the same small MLP under DDP on its own synthetic batches
and records, per step and without printing, the seconds of its own work
(data and forward: "local_s"), of backward with DDP's all-reduce and the
optimizer step ("sync_s"), the whole step, samples/s, the loss and its
memory. Rank --slow-rank sleeps --sleep-s seconds in its data loading every
step. One step runs under torch.profiler with record_function labels; the
"backward" label ends after the wait for the slowest rank on both backends
(gloo waits in loss.backward(), nccl on the GPU, so the script synchronizes
it inside the label). On a machine without a GPU, a CUDA build of torch has
the profiler log a few lines such as "gpuGetDeviceCount failed" to stderr:
harmless. Rank 0 gathers
everything, writes it to --results (JSON) and, with --tb-dir, to TensorBoard
(tensorboard --logdir build/12_tb).
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from ddp_course.harness.script_args import script_parser
from ddp_course.models import MLP
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools import monitor
from ddp_course.tools.records import write_results


def parse_args():
    p = script_parser(__doc__, steps=8, batch_size=32, results=None)
    p.add_argument("--slow-rank", type=int, default=-1, help="the slow rank (-1: the last)")
    p.add_argument("--sleep-s", type=float, default=0.05, help="its extra seconds per step")
    p.add_argument("--profile-step", type=int, default=3, help="the step run under the profiler")
    p.add_argument("--tb-dir", help="write TensorBoard event files here (rank 0)")
    return p.parse_args()


def profiled_sections(prof, labels):
    """Milliseconds of CPU time per record_function label, and the 5 costliest ops."""
    events = prof.key_averages()
    ms = {e.key: e.cpu_time_total / 1e3 for e in events if e.key in labels}
    ops = sorted((e for e in events if e.key not in labels), key=lambda e: -e.self_cpu_time_total)
    return {"sections_ms": ms, "top_ops": [[e.key, e.self_cpu_time_total / 1e3] for e in ops[:5]]}


def main():
    args = parse_args()
    with distributed() as ctx:
        log = get_logger(ctx)
        slow = args.slow_rank % ctx.world_size
        torch.manual_seed(0)
        net = MLP(in_features=64, hidden=128, depth=2).to(ctx.device)
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = DDP(net, device_ids=ids) if ctx.is_distributed else net
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(ctx.rank)
        metrics = monitor.RankMetrics(ctx.rank, ctx.device)
        profiled = None
        for step in range(args.steps):
            prof = profile(activities=[ProfilerActivity.CPU]) if step == args.profile_step else None
            if prof is not None:
                prof.__enter__()
            with metrics.step(step, samples=args.batch_size) as row:
                with metrics.timed(row, "local_s"), record_function("data"):
                    if ctx.rank == slow:
                        time.sleep(args.sleep_s)  # the straggler: slow storage, a busy core
                    x = torch.randn(args.batch_size, 64, generator=gen)
                    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
                with metrics.timed(row, "local_s"), record_function("forward"):
                    loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
                with metrics.timed(row, "sync_s"), record_function("backward"):
                    opt.zero_grad()
                    loss.backward()  # DDP's all-reduce: waits for the slowest rank
                    opt.step()
                    if ctx.device.type == "cuda":
                        # nccl: backward returns once the all-reduce is queued and the GPU
                        # waits; end the label after that wait, as gloo's host waits in it.
                        torch.cuda.synchronize(ctx.device)
                row["loss"] = loss.item()
            if prof is not None:
                prof.__exit__(None, None, None)
                profiled = profiled_sections(prof, {"data", "forward", "backward"})
        per_rank = monitor.gather_metrics(metrics, ctx)
        profiles = [profiled] * ctx.world_size
        if ctx.is_distributed:
            profiles = [None] * ctx.world_size if ctx.is_main else None
            dist.gather_object(profiled, profiles, dst=0)
        if ctx.is_main:
            if args.tb_dir:
                monitor.write_tensorboard(args.tb_dir, per_rank)
            local = [[row["local_s"] for row in rows[1:]] for rows in per_rank]  # no warm-up
            found = monitor.find_stragglers(local) if ctx.world_size > 1 else []
            log.info(f"stragglers from per-rank local time: {found} (slept on rank {slow})")
            write_results(ctx, args.results, {
                "world_size": ctx.world_size, "slow_rank": slow, "sleep_s": args.sleep_s,
                "stragglers": found, "ranks": per_rank, "profiles": profiles,
            })


if __name__ == "__main__":
    main()
