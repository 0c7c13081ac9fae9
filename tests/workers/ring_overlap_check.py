"""Worker: ring attention with its passes overlapped (as written) against waited for at once.

As written, ``ring_attention`` posts each pass (``cp.RingPass``) before the step's blocks
and waits for it after them. The other variant (``RingOps(ring_pass=WaitedAtOnce)``) waits
as soon as it posts, so no transfer overlaps a block. Both compute the same thing in the
same order: outputs and gradients must be equal bit for bit. Each variant runs forward and
backward ``--repeats`` times after one warm-up; the time of a run is the slowest rank's. On
GPUs (nccl) the difference is the communication the overlap hides; on CPU with gloo the
ranks share the cores and it means little.

    torchrun --nproc_per_node=2 tests/workers/ring_overlap_check.py
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_course import context_parallel as cp
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--n-heads", type=int, default=8)
parser.add_argument("--t-local", type=int, default=64, help="tokens per rank")
parser.add_argument("--head-dim", type=int, default=16)
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--results")
args = parser.parse_args()


class WaitedAtOnce(cp.RingPass):
    """A pass that waits as soon as it is posted: nothing overlaps it."""

    def __init__(self, tensors, group=None, tag=0):
        super().__init__(tensors, group, tag)
        self.done = super().wait()

    def wait(self):
        return self.done


VARIANTS = {"overlapped": cp.RingOps(), "waited at once": cp.RingOps(ring_pass=WaitedAtOnce)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(q, k, v, grad, ops):
    local = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cp.ring_attention(*local, causal=True, layout="zigzag", ops=ops)
    (out * grad).sum().backward()
    return [out.detach(), *(x.grad for x in local)]


with distributed() as ctx:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(ctx.rank)
    shape = (args.batch_size, args.n_heads, args.t_local, args.head_dim)
    q, k, v, grad = (torch.randn(shape, generator=gen).to(ctx.device, dtype) for _ in range(4))
    results, times = {}, {}
    for name, ops in VARIANTS.items():
        results[name] = step(q, k, v, grad, ops)  # warm-up
        runs = []
        for _ in range(args.repeats):
            sync(ctx.device)
            dist.barrier()
            start = time.perf_counter()
            step(q, k, v, grad, ops)
            sync(ctx.device)
            took = torch.tensor(time.perf_counter() - start, device=ctx.device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank
            runs.append(took.item())
        times[name] = statistics.median(runs)
    equal = all(torch.equal(a, b) for a, b in zip(*results.values()))
    write_results(
        ctx,
        args.results,
        {
            "world_size": ctx.world_size,
            "device": str(ctx.device),
            "backend": ctx.backend,
            "shape": list(shape),
            "dtype": args.dtype,
            "equal": equal,
            "median_s": times,
            "overlapped_over_waited": times["overlapped"] / times["waited at once"],
        },
    )
