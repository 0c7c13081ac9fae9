"""BatchNorm under DDP, and a SyncBatchNorm from scratch equal to BatchNorm on the global batch.

Run from the repository root:
    python scripts/07_sync_batchnorm.py
    torchrun --nproc_per_node=2 scripts/07_sync_batchnorm.py

Each rank normalises its own slice of one global batch three ways: plain
BatchNorm (statistics of the slice), the SyncBatchNorm below (statistics of
the global batch, two all-reduces) and, on GPUs only, torch's SyncBatchNorm.
Every rank also runs BatchNorm on the whole global batch as the reference.
"""

import torch
import torch.distributed as dist
from torch import nn

from ddp_course.harness.script_args import script_parser
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.records import write_results


class AllReduceSum(torch.autograd.Function):
    """Sum over ranks, differentiable: the gradient of a sum reaches every term.

    Rank r's output is S = sum_q s_q, and the global loss is sum_q L_q(S), so
    dL/ds_r = sum_q dL_q/dS: the backward is an all-reduce of the gradients.
    """

    @staticmethod
    def forward(ctx, tensor):
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class SyncBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the batch of every rank: per-channel sums are all-reduced.

    Input ``float32 [B, C]`` or ``[B, C, L]`` on each rank; the statistics
    are those of the concatenated global batch. The all-reduce is
    differentiable (:class:`AllReduceSum`), so gradients flow to the inputs of
    every rank as they would through one big batch.
    """

    def forward(self, x):
        if not self.training or not dist.is_initialized():
            return super().forward(x)
        dims = [0, *range(2, x.dim())]  # every dimension but the channels
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        sums = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        sums = AllReduceSum.apply(sums)  # NEW: global sums, differentiable
        c = x.shape[1]
        n = sums[-1]
        mean = sums[:c] / n
        var = sums[c : 2 * c] / n - mean * mean  # biased, as BatchNorm normalises
        with torch.no_grad():  # running statistics use the unbiased variance
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
            self.num_batches_tracked += 1
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def parse_args():
    p = script_parser(__doc__, batch_size=8, results=None, help={"batch_size": "samples per rank"})
    p.add_argument("--channels", type=int, default=6)
    return p.parse_args()


def run(layer, x, probe):
    """Output, input gradient and parameter gradients of ``sum(probe * layer(x))``."""
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (probe * y).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        n, b, c = dist.get_world_size(), args.batch_size, args.channels
        gen = torch.Generator().manual_seed(0)  # the same global batch on every rank
        x = torch.randn(n * b, c, 5, generator=gen) * 2 + torch.arange(n * b).view(-1, 1, 1) / b
        probe = torch.randn(n * b, c, 5, generator=gen)
        mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
        dev = ctx.device
        x, probe = x.to(dev), probe.to(dev)

        reference = nn.BatchNorm1d(c).to(dev)
        ref_y, ref_dx, ref_dw, ref_db = run(reference, x, probe)
        local = nn.BatchNorm1d(c).to(dev)
        loc_y, *_ = run(local, x[mine], probe[mine])
        ours = SyncBatchNorm(c).to(dev)
        y, dx, dw, db = run(ours, x[mine], probe[mine])
        # Parameter gradients are per rank; the global batch's gradient is their sum.
        dw, db = dw.clone(), db.clone()
        dist.all_reduce(dw)
        dist.all_reduce(db)
        checks = {
            "output": (y, ref_y[mine]),
            "input_grad": (dx, ref_dx[mine]),
            "weight_grad": (dw, ref_dw),
            "bias_grad": (db, ref_db),
            "running_mean": (ours.running_mean, reference.running_mean),
            "running_var": (ours.running_var, reference.running_var),
        }
        diffs = {k: (a - r).abs().max().item() for k, (a, r) in checks.items()}
        for a, r in checks.values():
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)
        log.info(f"SyncBatchNorm from scratch vs BatchNorm on the global batch: {diffs}")
        plain = {
            "output_diff": (loc_y - ref_y[mine]).abs().max().item(),
            "mean_diff": (local.running_mean - reference.running_mean).abs().max().item(),
        }
        log.info(f"plain BatchNorm on this rank's slice vs the global batch: {plain}")

        if dev.type == "cuda":
            theirs = nn.SyncBatchNorm(c).to(dev)
            t_y, t_dx, *_ = run(theirs, x[mine], probe[mine])
            torch.testing.assert_close(t_y, ref_y[mine], rtol=1e-4, atol=1e-5)
            torch_sync = "equal to BatchNorm on the global batch"
        else:
            torch_sync = "skipped: torch's nn.SyncBatchNorm runs on CUDA devices only"
        log.info(f"torch's SyncBatchNorm: {torch_sync}")
        all_plain = [None] * n
        dist.all_gather_object(all_plain, plain)
        write_results(ctx, args.results, {"world_size": n, "sync_diffs": diffs,
                                          "plain_per_rank": all_plain,
                                          "torch_sync_batchnorm": torch_sync})


if __name__ == "__main__":
    main()
