"""Worker for tests/multiprocess/test_collectives.py: hand-written collectives against
torch.distributed.

torchrun --nproc_per_node=3 tests/workers/collectives_check.py --results out.json

Every rank checks ring all-reduce, ring reduce-scatter, ring all-gather and the
parameter-server all-reduce against ``dist.all_reduce`` / ``dist.all_gather``
for several dtypes, odd lengths and ops, and checks the bytes each call
counted against the formulas; rank 0 writes what every rank measured.
"""

import argparse

import torch
import torch.distributed as dist

from ddp_course.collectives import (
    parameter_server_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from ddp_course.comm_cost import parameter_server_bytes, ring_bytes
from ddp_course.partition import partition
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)
CROSS = (torch.float32, torch.int64)  # dtypes checked with every op, not only sum
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def rank_tensor(numel: int, dtype: torch.dtype, rank: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        t = torch.randn(numel, generator=gen, dtype=dtype)
    else:
        t = torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)
    return t.to(device)


def reference(x: torch.Tensor, op: str, world_size: int, group=None) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, op=TORCH_OPS.get(op, dist.ReduceOp.SUM), group=group)
    if op == "avg":
        if out.is_floating_point():
            out /= world_size
        else:
            out = torch.div(out, world_size, rounding_mode="trunc")
    return out


def as_list(stats) -> list[int]:
    return [stats.bytes_sent, stats.bytes_received, stats.steps]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results")
    args = parser.parse_args()
    with distributed() as ctx:
        rank, n, dev = ctx.rank, ctx.world_size, ctx.device
        # Odd lengths, lengths below N (empty chunks) and zero, for the two
        # main dtypes; the others at one odd length. 1001 elements in 1 KiB
        # segments also exercise a short last segment.
        lengths = sorted({0, 1, n - 1, n + 1, 1001})
        cases = 0
        for dtype in DTYPES:
            for numel in lengths if dtype in CROSS else (1001,):
                x = rank_tensor(numel, dtype, rank, dev)
                esize = x.element_size()
                ops = ("sum", "avg", "max", "min") if dtype in CROSS and numel > n else ("sum",)
                for op in ops:
                    want = reference(x, op, n)
                    got = x.clone()
                    stats = ring_all_reduce(got, op, segment_bytes=1024)
                    torch.testing.assert_close(got, want, msg=f"ring {dtype} {numel} {op}")
                    assert stats == ring_bytes(numel, esize, n, rank), (stats, numel)
                    for root in sorted({0, n - 1}):
                        got = x.clone()
                        stats = parameter_server_all_reduce(got, op, root=root, segment_bytes=1024)
                        torch.testing.assert_close(got, want, msg=f"ps {dtype} {numel} {op}")
                        assert stats == parameter_server_bytes(numel, esize, n, rank, root)
                    cases += 3
                # Reduce-scatter alone: this rank's chunk of the all-reduced tensor.
                start, stop = partition(numel, n)[rank]
                got = x.clone()
                chunk, _ = ring_reduce_scatter(got, "sum")
                torch.testing.assert_close(chunk, reference(x, "sum", n)[start:stop])
                # All-gather alone: every rank contributes its own chunk.
                full = torch.zeros_like(x)
                for r, (a, b) in enumerate(partition(numel, n)):
                    if r == rank:
                        full[a:b] = rank_tensor(numel, dtype, r, dev)[a:b]
                ring_all_gather(full)
                parts = [torch.zeros_like(x) for _ in range(n)]
                dist.all_gather(parts, x)
                bounds = partition(numel, n)
                want = torch.cat([p[a:b] for p, (a, b) in zip(parts, bounds, strict=True)])
                torch.testing.assert_close(full, want)
                cases += 2
        # Shapes other than 1-D, a reused scratch buffer, and a 2-D view.
        x = rank_tensor(6 * 5, torch.float32, rank, dev).view(6, 5)
        scratch = torch.empty(x.numel(), device=dev)
        for _ in range(2):
            got = x.clone()
            ring_all_reduce(got, "sum", scratch=scratch)
            torch.testing.assert_close(got, reference(x, "sum", n))
        # A subgroup: every rank but rank 0 (ranks in it are renumbered 0..n-2).
        sub_ok = None  # how many ranks checked the subgroup (None: N < 3)
        if n >= 3:
            group = dist.new_group(list(range(1, n)))
            if rank > 0:
                x = rank_tensor(101, torch.float32, rank, dev)
                got, want = x.clone(), reference(x, "sum", n - 1, group)
                ring_all_reduce(got, "sum", group=group)
                torch.testing.assert_close(got, want)
                got = x.clone()
                parameter_server_all_reduce(got, "sum", group=group)
                torch.testing.assert_close(got, want)
                sub_ok = 1
            # Rank 0 writes the results, so it counts the subgroup's checks.
            flag = torch.tensor([sub_ok or 0], device=dev)
            dist.all_reduce(flag)
            sub_ok = int(flag.item())
        # The bytes every rank counted for one float32 tensor of 12,000
        # elements (48,000 bytes; divisible by 2, 3 and 4) and one of 1,001.
        counted = {}
        for numel in (12_000, 1_001):
            x = torch.ones(numel, device=dev)
            ring = as_list(ring_all_reduce(x.clone()))
            ps = as_list(parameter_server_all_reduce(x.clone()))
            per_rank = [None] * n
            dist.all_gather_object(per_rank, {"ring": ring, "ps": ps})
            counted[str(numel)] = per_rank
        write_results(
            ctx,
            args.results,
            {
                "world_size": n,
                "backend": ctx.backend,
                "cases": cases,
                "bytes": counted,
                "subgroup_checked": sub_ok,
            },
        )


if __name__ == "__main__":
    main()
