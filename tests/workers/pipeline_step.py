"""Worker: one pipelined step per schedule against one step of a single-process model.

Stage k of a ``LayerStack`` runs on rank k; the batch is cut into micro-batches.
Every rank also holds the whole model (same seed) as the reference and takes one
plain SGD step on the whole batch; the stage's gradients and parameters after
the step must equal the reference's layers of that stage. A second part times
each schedule with sleeping stages (the bubble against the formula).
"""

import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch.nn.functional import cross_entropy

from ddp_course import pipeline
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(
    microbatches=4,
    batch_size=10,  # not divisible by 4: uneven shares
    sleep_s=0.08,  # forward sleep; backward 2x
)


def layer_stack():
    torch.manual_seed(0)
    return LayerStack(in_features=12, width=16, num_layers=3, num_classes=5)


with distributed(device="cpu") as ctx:
    p, k, m = ctx.world_size, ctx.rank, args.microbatches
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, 12, generator=gen)
    y = torch.randint(0, 5, (args.batch_size,), generator=gen)
    reference = layer_stack()
    ref_loss = cross_entropy(reference(x), y)
    ref_loss.backward()
    ref_stage = reference.stage(k, p)  # the same layer objects as the reference's
    ref_grads = [q.grad.clone() for q in ref_stage.parameters()]
    with torch.no_grad():
        ref_after = [q - 0.1 * q.grad for q in ref_stage.parameters()]

    out = {"equal": {}, "timelines": {}}
    for name in pipeline.SCHEDULES:
        stage = layer_stack().stage(k, p)
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        opt.zero_grad()
        table = pipeline.schedule(name, p, m)
        result = pipeline.run_schedule(
            table,
            stage,
            k,
            inputs=pipeline.split_microbatches(x, m),
            targets=pipeline.split_microbatches(y, m),
            loss_fn=cross_entropy,
        )
        grad_diff = max(
            (g - q.grad).abs().max().item() for g, q in zip(ref_grads, stage.parameters())
        )
        for g, q in zip(ref_grads, stage.parameters()):
            torch.testing.assert_close(q.grad, g, rtol=1e-5, atol=1e-6)
        opt.step()
        for r, q in zip(ref_after, stage.parameters()):
            torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-6)
        loss_gap = abs(result.loss - ref_loss.item()) if result.loss is not None else None
        gathered = [None] * p
        mine = {
            "grad_diff": grad_diff,
            "loss_gap": loss_gap,
            "peak": result.peak_in_flight,
            "order": [str(e.action) for e in result.events],
            "bytes": result.bytes_sent,
        }
        dist.all_gather_object(gathered, mine)
        out["equal"][name] = gathered

        if name == "naive":
            continue  # its bubble is GPipe's with m = 1; not timed, to keep the test short
        # The same schedule with sleeping stages: measured bubble and timeline.
        timed = pipeline.run_schedule(
            table,
            layer_stack().stage(k, p),
            k,
            inputs=pipeline.split_microbatches(x, m),
            targets=pipeline.split_microbatches(y, m),
            loss_fn=cross_entropy,
            forward_sleep_s=args.sleep_s,
            backward_sleep_s=2 * args.sleep_s,
        )
        tl = pipeline.gather_timeline(timed)
        out["timelines"][name] = tl.to_records()

    if ctx.is_main:
        out.update(world_size=p, microbatches=m)
        write_results(ctx, args.results, out)
