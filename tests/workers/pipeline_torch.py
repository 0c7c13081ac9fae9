"""Worker: our executor against torch.distributed.pipelining on the same stages and batch.

For GPipe and 1F1B, rank k runs stage k of the same ``LayerStack`` twice: once
with ``ddp_course.pipeline.run_schedule`` and once with PyTorch's
``PipelineStage`` and ``ScheduleGPipe``/``Schedule1F1B``. Gradients and the
loss must agree (equal micro-batches: torch scales gradients by 1/m).
"""

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.functional import cross_entropy

from ddp_course import pipeline
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(microbatches=4)

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_of(k, p):
    torch.manual_seed(0)
    return LayerStack(in_features=12, width=16, num_layers=3, num_classes=5).stage(k, p)


with distributed(device="cpu") as ctx:
    p, k, m = ctx.world_size, ctx.rank, args.microbatches
    first, last = k == 0, k == p - 1
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3 * m, 12, generator=gen)  # m equal micro-batches of 3
    y = torch.randint(0, 5, (3 * m,), generator=gen)
    out = {}
    for name, torch_schedule in TORCH_SCHEDULES.items():
        ours = stage_of(k, p)
        result = pipeline.run_schedule(
            pipeline.schedule(name, p, m),
            ours,
            k,
            inputs=pipeline.split_microbatches(x, m),
            targets=pipeline.split_microbatches(y, m),
            loss_fn=cross_entropy,
        )
        theirs = stage_of(k, p)
        stage = PipelineStage(theirs, k, p, ctx.device)
        sched = torch_schedule(stage, n_microbatches=m, loss_fn=cross_entropy)
        losses = []
        if first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        assert all(q.grad.abs().sum() > 0 for q in theirs.parameters()), "no gradient reached"
        diff = 0.0
        for a, b in zip(ours.parameters(), theirs.parameters()):
            diff = max(diff, (a.grad - b.grad).abs().max().item())
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
        loss_gap = abs(result.loss - torch.stack(losses).mean().item()) if last else None
        gathered = [None] * p
        dist.all_gather_object(gathered, {"grad_diff": diff, "loss_gap": loss_gap})
        out[name] = gathered
    write_results(ctx, args.results, {"world_size": p, "schedules": out})
