"""Lesson 03: point-to-point and every collective, each rank's tensors before and after.

python scripts/03_collectives.py                                 # a group of one rank
torchrun --nproc_per_node=4 scripts/03_collectives.py --results build/03_collectives.json
torchrun --nproc_per_node=2 scripts/03_collectives.py --deadlock --timeout-s 3  # fails
torchrun --nproc_per_node=4 scripts/03_collectives.py --device cpu  # gloo even with GPUs

Every rank records what it held before and after each operation; rank 0
gathers the records and writes them to --results. With --deadlock every
rank calls recv before its send, so all of them wait for ever; the
process-group timeout (--timeout-s) turns the hang into an error: gloo's recv
raises "Timed out ...", nccl's watchdog reports a "collective operation
timeout" and takes the process down.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from ddp_course.collectives import ring_reduce_scatter
from ddp_course.harness.ports import free_port
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.records import write_results

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS")


def point_to_point(ctx) -> dict:
    """send/recv, isend/irecv and batch_isend_irecv around the ring of ranks."""
    rank, n, dev = ctx.rank, ctx.world_size, ctx.device
    right, left = (rank + 1) % n, (rank - 1) % n
    out = {}
    # Blocking send/recv: even ranks send first, odd ranks receive first, so
    # every blocking call has a partner that is already waiting for it. (gloo
    # blocks the host; nccl queues them on the GPU in this order, and a queued
    # recv blocks what comes after it on the stream just the same.)
    mine, got = (
        torch.tensor([100 + rank], device=dev),
        torch.zeros(1, dtype=torch.int64, device=dev),
    )
    if rank % 2 == 0:
        dist.send(mine, right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(mine, right)
    out["send_recv"] = {"sent": mine.tolist(), "to": right, "received": got.tolist(), "from": left}
    # isend/irecv return at once; the data is there only after wait().
    # Rank 0 sends late on purpose, so rank 1 can look at its buffer before.
    if n >= 2 and rank in (0, 1):
        buf = torch.zeros(3, dtype=torch.int64, device=dev)
        if rank == 0:
            time.sleep(0.5)
            dist.isend(torch.tensor([7, 8, 9], device=dev), 1).wait()
        else:
            work = dist.irecv(buf, 0)
            before, done_before = buf.tolist(), work.is_completed()
            # gloo: wait() blocks until the data is in buf. nccl: it makes the current
            # CUDA stream wait and returns; synchronize() then blocks the host too.
            work.wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            out["irecv"] = {
                "before_wait": before,
                "completed_before_wait": done_before,
                "after_wait": buf.tolist(),
                "completed_after_wait": work.is_completed(),
            }
    # batch_isend_irecv: post a whole list of sends and receives together.
    got = torch.zeros(2, dtype=torch.int64, device=dev)
    mine = torch.tensor([rank, rank * rank], device=dev)
    ops = [dist.P2POp(dist.irecv, got, left), dist.P2POp(dist.isend, mine, right)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["batch"] = {"received": got.tolist(), "from": left}
    return out


def collectives(ctx) -> dict:
    """Every collective once: this rank's tensor before and after."""
    rank, n, dev = ctx.rank, ctx.world_size, ctx.device

    def x():  # rank r holds [10r, 10r + 1]
        return torch.tensor([10 * rank, 10 * rank + 1], device=dev)

    def per_rank():  # rank r holds [10r, 10r + 1, ..., 10r + n - 1]: one entry for each rank
        return torch.arange(n, device=dev) + 10 * rank

    out = {}
    t = x()
    before = t.tolist()
    dist.broadcast(t, src=0)
    out["broadcast"] = {"before": before, "after": t.tolist()}

    table = torch.arange(2 * n, device=dev).view(n, 2)  # only rank 0's copy is sent
    t = torch.zeros(2, dtype=torch.int64, device=dev)
    dist.scatter(t, list(table) if rank == 0 else None, src=0)
    out["scatter"] = {"before": table.tolist() if rank == 0 else None, "after": t.tolist()}

    t = x()
    parts = [torch.zeros_like(t) for _ in range(n)] if rank == 0 else None
    dist.gather(t, parts, dst=0)
    out["gather"] = {"before": t.tolist(),
                     "after": [p.tolist() for p in parts] if rank == 0 else None}

    t = x()
    parts = [torch.zeros_like(t) for _ in range(n)]
    dist.all_gather(parts, t)
    out["all_gather"] = {"before": t.tolist(), "after": [p.tolist() for p in parts]}

    t = x()
    before = t.tolist()
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    out["reduce"] = {"before": before, "after": t.tolist()}

    t = x()
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    out["all_reduce"] = {"before": before, "after": t.tolist()}

    t = per_rank()
    result = torch.zeros(1, dtype=t.dtype, device=dev)
    try:
        dist.reduce_scatter(result, list(t.split(1)), op=dist.ReduceOp.SUM)
        via = "dist.reduce_scatter"
    except RuntimeError as exc:
        # Some gloo versions have no reduce_scatter: say so and use the
        # point-to-point ring of notebook 04 instead.
        get_logger(ctx).warning(f"dist.reduce_scatter failed ({exc}); using the ring instead")
        result, _ = ring_reduce_scatter(t.clone(), "sum")
        via = "ddp_course.collectives.ring_reduce_scatter"
    out["reduce_scatter"] = {"before": t.tolist(), "after": result.tolist(), "via": via}

    t = per_rank()
    parts = [torch.zeros(1, dtype=t.dtype, device=dev) for _ in range(n)]
    try:
        dist.all_to_all(parts, list(t.split(1)))
        via = "dist.all_to_all"
    except RuntimeError as exc:
        # gloo of torch 2.11 has only the one-tensor form: the same exchange, one buffer.
        get_logger(ctx).warning(f"dist.all_to_all failed ({exc}); using all_to_all_single")
        single = torch.zeros(n, dtype=t.dtype, device=dev)
        dist.all_to_all_single(single, t)
        parts, via = list(single.split(1)), "dist.all_to_all_single"
    out["all_to_all"] = {"before": t.tolist(), "after": torch.cat(parts).tolist(), "via": via}

    # barrier: rank r arrives 0.2 * r s late; everyone leaves with the last.
    time.sleep(0.2 * rank)
    arrived = time.time()
    dist.barrier()
    out["barrier"] = {"arrived": arrived, "left": time.time()}
    return out


def subgroups(ctx) -> dict:
    """Split the world into even and odd ranks; all_reduce the rank inside each half."""
    evens = list(range(0, ctx.world_size, 2))
    odds = list(range(1, ctx.world_size, 2))
    # new_group is called by every rank for every group, member or not, in the same order.
    groups = {"even": dist.new_group(evens), "odd": dist.new_group(odds) if odds else None}
    mine = "even" if ctx.rank % 2 == 0 else "odd"
    t = torch.tensor([ctx.rank], device=ctx.device)
    dist.all_reduce(t, group=groups[mine])  # only the ranks of `mine` take part
    return {"group": mine, "members": evens if mine == "even" else odds,
            "rank_in_group": dist.get_rank(groups[mine]), "sum": t.item()}


def sync_versus_async(ctx, numel: int = 4 * 2**20) -> dict:
    """all_reduce without and with async_op=True, with work done before wait().

    Seconds on the host clock. ``*_call_s``: until the all_reduce call returned
    to Python. gloo's plain call blocks the host until the result is in t;
    nccl's only enqueues the collective on a CUDA stream and returns (later
    work on the current stream waits for it). ``*_total_s``: until the
    all_reduce and the products were done, read after torch.cuda.synchronize
    on a GPU, so the same on both backends.
    """
    dev = ctx.device
    a = torch.randn(256, 256, device=dev)

    def compute():
        for _ in range(20):
            a.mul_(0.5).add_(a @ a * 1e-3)

    def finish():  # a clock read after GPU work must wait for the GPU first
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    t = torch.ones(numel, device=dev)
    finish()
    start = time.perf_counter()
    dist.all_reduce(t)  # gloo: returns when the result is in t; nccl: once it is queued
    sync_call = time.perf_counter() - start
    # Read at once: gloo has the sum in t already; on nccl reading waits for the stream.
    sync_ok = bool((t == ctx.world_size).all())
    compute()  # runs after the all_reduce (nccl: queued behind it on the stream)
    finish()
    sync_total = time.perf_counter() - start

    t = torch.ones(numel, device=dev)
    finish()
    start = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)  # returns at once with a Work handle
    async_call = time.perf_counter() - start
    completed_at_call = work.is_completed()
    compute()  # overlaps with the communication
    work.wait()  # gloo: blocks until t holds the sum; nccl: the current stream waits for it
    finish()  # nccl: the host waits too, so the clock and is_completed() see the end
    async_total = time.perf_counter() - start
    return {"numel": numel, "sync_call_s": sync_call, "sync_total_s": sync_total,
            "async_call_s": async_call, "async_total_s": async_total,
            "completed_at_call": completed_at_call, "completed_after_wait": work.is_completed(),
            "sync_ok": sync_ok, "async_ok": bool((t == ctx.world_size).all())}


def deadlock(ctx) -> None:
    """Every rank receives before it sends: each waits for a send that never comes.

    gloo: recv blocks the host and raises "Timed out ..." after --timeout-s.
    nccl: recv is queued on the GPU and the host goes on; the queued recv never
    completes, and the watchdog thread reports "... collective operation
    timeout ... before timing out" and takes the process down.
    """
    got = torch.zeros(1, device=ctx.device)
    left, right = (ctx.rank - 1) % ctx.world_size, (ctx.rank + 1) % ctx.world_size
    get_logger(ctx).info("every rank calls recv first: nobody sends, so everybody waits")
    dist.recv(got, left)  # never completes: the process-group timeout ends it
    dist.send(torch.ones(1, device=ctx.device), right)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", help="rank 0 writes every rank's records here")
    parser.add_argument("--deadlock", action="store_true", help="recv before send on every rank")
    parser.add_argument(
        "--timeout-s", type=float, default=None, help="process-group timeout in seconds"
    )
    parser.add_argument("--device", help="e.g. cpu: run on CPU with gloo even where GPUs are")
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        # Run as plain python: make a group of one (env:// init reads these),
        # so every collective below still runs.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with distributed(device=args.device, timeout_s=args.timeout_s) as ctx:
        log = get_logger(ctx)
        if args.deadlock:
            deadlock(ctx)
        record = {"env": {k: os.environ.get(k) for k in TORCHRUN_VARS}}
        if ctx.world_size >= 2:
            record["point_to_point"] = point_to_point(ctx)
        else:
            log.info("point-to-point needs a peer: skipped with one rank (use torchrun)")
        record["collectives"] = collectives(ctx)
        record["subgroup"] = subgroups(ctx)
        timing = sync_versus_async(ctx)
        # Gather every rank's record to rank 0 (a collective on Python objects).
        records = [None] * ctx.world_size
        dist.all_gather_object(records, record)
        log.info(f"{ctx.world_size} ranks, backend {ctx.backend}: records gathered on rank 0")
        available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                     "mpi": dist.is_mpi_available()}
        write_results(ctx, args.results, {
            "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
            "available_backends": available, "ranks": records, "sync_versus_async": timing,
        })


if __name__ == "__main__":
    main()
