"""Lesson 04: ring and parameter-server all-reduce from send/recv, checked, counted, timed.

python scripts/04_allreduce.py                                   # one process: checks only
torchrun --nproc_per_node=4 scripts/04_allreduce.py --max-bytes 0  # checks and bytes, no sweep
torchrun --nproc_per_node=2 scripts/04_allreduce.py --results build/04_allreduce.json

Every rank first checks the hand-written ring and parameter server against
dist.all_reduce (odd lengths, float and integer, sum and avg; max and min) and counts the
bytes it moved. Then, for message sizes from --min-bytes to --max-bytes, it
times dist.all_reduce, the ring, the parameter server and two point-to-point
patterns that model the link: "send" (rank 0 to rank 1 only) and "exchange"
(every rank sends to its right neighbour and receives from its left one at
once, one ring step). Times are the slowest rank's, medians over repeats
after warm-up; algbw and busbw as in nccl-tests' PERFORMANCE.md; an
alpha-beta model t = alpha + S/B is fitted to each curve of three sizes or
more. busbw normalises by what a bandwidth-optimal all-reduce must move,
whatever the algorithm; the rate the busiest rank really sent at
("busiest_GBps") is reported beside it. On a GPU every timed call ends with
torch.cuda.synchronize (bench.time_op): nccl calls return once queued.
"""

import argparse
import math

import torch
import torch.distributed as dist

from ddp_course.collectives import parameter_server_all_reduce, ring_all_reduce
from ddp_course.comm_cost import parameter_server_bytes, ring_bytes
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.bench import algbw, busbw, fit_alpha_beta, message_sizes, summarize, time_op
from ddp_course.tools.records import write_results

BUSBW_OF = {"torch": "all_reduce", "ring": "all_reduce", "ps": "all_reduce",
            "send": "sendrecv", "exchange": "sendrecv"}


def check(ctx) -> dict:
    """Ring and parameter server equal dist.all_reduce; bytes equal the formulas."""
    n, cases = ctx.world_size, 0
    for dtype in (torch.float32, torch.int64):
        for numel in (1, n + 1, 1001):
            gen = torch.Generator().manual_seed(ctx.rank * 7919 + numel)
            x = torch.randint(-100, 100, (numel,), generator=gen).to(dtype).to(ctx.device)
            total = x.clone()
            if ctx.is_distributed:
                dist.all_reduce(total)
            for op in ("sum", "avg"):
                want = total
                if op == "avg":
                    # Integers: truncated toward zero (see collectives._finish_avg).
                    exact = dtype.is_floating_point
                    want = total / n if exact else total.div(n, rounding_mode="trunc")
                for name, fn, formula in (
                    ("ring", ring_all_reduce, ring_bytes),
                    ("ps", parameter_server_all_reduce, parameter_server_bytes),
                ):
                    got = x.clone()
                    stats = fn(got, op)
                    torch.testing.assert_close(got, want, msg=f"{name} {dtype} {numel} {op}")
                    assert stats == formula(numel, x.element_size(), n, ctx.rank), (name, stats)
                    cases += 1
    # max and min, float and integer, against dist.all_reduce's MAX and MIN.
    extremes = 0
    for dtype in (torch.float32, torch.int64):
        gen = torch.Generator().manual_seed(ctx.rank * 7919 + 7)
        x = torch.randint(-100, 100, (n + 1,), generator=gen).to(dtype).to(ctx.device)
        for op, reduce_op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            want = x.clone()
            if ctx.is_distributed:
                dist.all_reduce(want, op=reduce_op)
            for name, fn in (("ring", ring_all_reduce), ("ps", parameter_server_all_reduce)):
                got = x.clone()
                fn(got, op)
                torch.testing.assert_close(got, want, msg=f"{name} {dtype} {op}")
                extremes += 1
    # What every rank counted for one float32 tensor of K = 48,000 bytes.
    numel = 12_000
    counted = {}
    for name, fn in (("ring", ring_all_reduce), ("ps", parameter_server_all_reduce)):
        stats = fn(torch.ones(numel, device=ctx.device))
        mine = [stats.bytes_sent, stats.bytes_received, stats.steps]
        per_rank = [mine]
        if ctx.is_distributed:
            per_rank = [None] * n
            dist.all_gather_object(per_rank, mine)
        counted[name] = per_rank
    return {"cases": cases, "extremes": extremes, "numel": numel, "element_size": 4, **counted}


def busiest_bytes(name: str, size: int, n: int) -> int | None:
    """Bytes the busiest rank sends in one call of `name` on `size` bytes (None: unknown)."""
    if name == "ring":
        return max(ring_bytes(size // 4, 4, n, r).bytes_sent for r in range(n))
    if name == "ps":
        return parameter_server_bytes(size // 4, 4, n, 0).bytes_sent  # the server
    if name in ("send", "exchange"):
        return size
    return None  # the backend's own algorithm is not ours to count


def sweep(ctx, sizes, warmup, repeats, segment_bytes) -> dict:
    """Time every algorithm at every size; the algorithms take turns each repeat."""
    n, log = ctx.world_size, get_logger(ctx)
    max_numel = sizes[-1] // 4
    tensor = torch.zeros(max_numel, device=ctx.device)  # zeros: sums stay finite
    recv = torch.empty(max_numel, device=ctx.device)
    # Receive buffers allocated once: a fresh buffer per call is page-faulted
    # in on first touch, which made the ring 1.4x slower at 64 MiB here.
    ring_scratch = torch.empty(math.ceil(max_numel / n), device=ctx.device)
    ps_scratch = torch.empty((n - 1) * max_numel if ctx.rank == 0 else 0, device=ctx.device)
    right, left = (ctx.rank + 1) % n, (ctx.rank - 1) % n

    def algorithms(t, r):
        def send():
            if ctx.rank == 0:
                dist.send(t, 1)
            elif ctx.rank == 1:
                dist.recv(r, 0)

        def exchange():
            ops = [dist.P2POp(dist.irecv, r, left), dist.P2POp(dist.isend, t, right)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return {
            "torch": lambda: dist.all_reduce(t),
            "ring": lambda: ring_all_reduce(t, scratch=ring_scratch, segment_bytes=segment_bytes),
            "ps": lambda: parameter_server_all_reduce(
                t, scratch=ps_scratch, segment_bytes=segment_bytes
            ),
            "send": send,
            "exchange": exchange,
        }

    out = {name: {"median_s": [], "q1_s": [], "q3_s": [], "algbw_GBps": [], "busbw_GBps": [],
                  "busiest_GBps": [], "times_s": []}
           for name in BUSBW_OF}
    log.info(f"{'bytes':>10} " + " ".join(f"{name + ' ms':>12}" for name in BUSBW_OF))
    for size in sizes:
        numel = size // 4
        fns = algorithms(tensor[:numel], recv[:numel])
        times = {name: [] for name in fns}
        for fn in fns.values():
            time_op(fn, ctx, warmup=warmup, repeats=1)
        for _ in range(repeats):
            for name, fn in fns.items():
                times[name] += time_op(fn, ctx, warmup=0, repeats=1)
        for name, ts in times.items():
            t = summarize(ts)
            out[name]["median_s"].append(t.median)
            out[name]["q1_s"].append(t.q1)
            out[name]["q3_s"].append(t.q3)
            out[name]["times_s"].append(ts)  # repeat i of every algorithm ran back to back
            out[name]["algbw_GBps"].append(algbw(size, t.median) / 1e9)
            out[name]["busbw_GBps"].append(busbw(size, t.median, BUSBW_OF[name], n) / 1e9)
            sent = busiest_bytes(name, size, n)
            out[name]["busiest_GBps"].append(None if sent is None else sent / t.median / 1e9)
        line = " ".join(f"{out[name]['median_s'][-1] * 1e3:12.3f}" for name in BUSBW_OF)
        log.info(f"{size:>10} {line}")
    assert torch.count_nonzero(tensor) == 0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", help="rank 0 writes the JSON results here")
    parser.add_argument("--min-bytes", type=int, default=4096, help="smallest message (bytes)")
    parser.add_argument("--max-bytes", type=int, default=256 * 2**20,
                        help="largest message (bytes); 0: no sweep")
    parser.add_argument("--factor", type=int, default=2, help="size step of the sweep")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per size")
    parser.add_argument("--segment-bytes", type=int, default=4 * 2**20,
                        help="the ring and the server send in segments of this size")
    parser.add_argument("--device", help="e.g. cpu: gloo on a machine with fewer GPUs than ranks")
    args = parser.parse_args()
    if args.min_bytes < 4 or args.min_bytes % 4:
        parser.error("--min-bytes must be a positive multiple of 4 (float32 elements)")
    with distributed(device=args.device) as ctx:
        log = get_logger(ctx)
        checked = check(ctx)
        log.info(f"ring and parameter server equal dist.all_reduce in {checked['cases']} cases")
        results = {
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": str(ctx.device),
            "settings": {k: v for k, v in vars(args).items() if k != "results"},
            "checks": checked,
        }
        if args.max_bytes and ctx.world_size >= 2:
            sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
            timed = sweep(ctx, sizes, args.warmup, args.repeats, args.segment_bytes)
            results["sizes"] = sizes
            results["sweep"] = timed
            results["fits"] = {}
            # A line through two sizes fits them exactly, noise and all: its intercept
            # can come out negative. Fit alpha and B only over three sizes or more.
            if len(sizes) < 3:
                log.info(f"{len(sizes)} sizes: too few to fit alpha and B, none fitted")
            for name, row in timed.items() if len(sizes) >= 3 else ():
                fit = fit_alpha_beta(sizes, row["median_s"])
                results["fits"][name] = {
                    "alpha_s": fit.alpha,
                    "bandwidth_GBps": fit.bandwidth / 1e9,
                }
                log.info(f"{name:>8}: alpha {fit.alpha * 1e6:8.1f} us, "
                         f"B {fit.bandwidth / 1e9:6.2f} GB/s")
            ring, torch_ = timed["ring"]["algbw_GBps"], timed["torch"]["algbw_GBps"]
            results["ring_over_torch_algbw"] = [r / t for r, t in zip(ring, torch_, strict=True)]
        elif ctx.world_size == 1:
            log.info("one process: nothing to communicate, so no sweep (use torchrun)")
        write_results(ctx, args.results, results)


if __name__ == "__main__":
    main()
