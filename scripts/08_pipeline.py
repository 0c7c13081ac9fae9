r"""Pipeline parallelism: one training step of a layer stack split over ranks, timed.

Run from the repository root:
    python scripts/08_pipeline.py
    torchrun --nproc_per_node=2 scripts/08_pipeline.py --schedule gpipe 1f1b --microbatches 2 4
    torchrun --nproc_per_node=2 scripts/08_pipeline.py --stage-cost-s 0 --microbatches 1 4
    python scripts/08_pipeline.py --sweep --stage-cost-s 0.1 \
        --results benchmarks/cpu-2core/08_bubble.json

Rank k runs stage k, the k-th contiguous slice of a LayerStack, so there are as
many stages as ranks. For every schedule and number of micro-batches m the
script runs one pipelined step (ddp_course.pipeline.run_schedule: activations
forward and gradients backward with point-to-point operations, micro-batch
gradients accumulated) and asserts that each stage's gradients equal those of
the whole model on the whole batch in one process. It records every action's
start and end, the idle fraction (bubble) of each rank against GPipe's
(p-1)/(m+p-1), the activations each rank held at once and the bytes it sent.

--stage-cost-s S makes every forward sleep S seconds and every backward 2S (a
stand-in for a long GPU kernel, so that shared CPU cores do not distort the
bubble); --stage-cost-s 0 times the real computation instead. --sweep (plain
python only) launches the script itself with torchrun for 2, 3 and 4 ranks,
m in 1, 2, 4, 8, plus a real-compute run on 2 ranks, and writes all of it to
--results (minutes). Each sleeping job runs --sweep-repeats times (2) and keeps,
for every schedule and m, the run with the least idle time.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.functional import cross_entropy

from ddp_course import pipeline
from ddp_course.harness import launch
from ddp_course.harness.script_args import script_parser
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.records import write_results


def parse_args():
    meaning = {
        "batch_size": "samples per step (all stages)",
        "hidden": "features between the layers",
    }
    p = script_parser(__doc__, batch_size=32, hidden=64, results=None, help=meaning)
    p.add_argument("--schedule", nargs="+", choices=pipeline.SCHEDULES,
                   default=list(pipeline.SCHEDULES), help="schedules to run")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4],
                   help="numbers of micro-batches m (1F1B only where m >= stages)")
    p.add_argument("--stage-cost-s", type=float, default=0.05,
                   help="seconds each forward sleeps (backward 2x); 0: compute only")
    p.add_argument("--layers", type=int, default=4, help="hidden layers of the layer stack")
    p.add_argument("--no-torch", action="store_true",
                   help="skip the comparison with torch.distributed.pipelining")
    p.add_argument("--sweep", action="store_true", help="the p x m grid in one JSON (minutes)")
    p.add_argument("--sweep-stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--sweep-repeats", type=int, default=2,
                   help="runs of each sleeping job; the least idle one is kept")
    return p.parse_args()


def whole_model(args):
    torch.manual_seed(0)  # the same weights on every rank
    return LayerStack(in_features=784, width=args.hidden, num_layers=args.layers)


def whole_batch(args):
    gen = torch.Generator().manual_seed(1)  # the same batch on every rank
    x = torch.randn(args.batch_size, 784, generator=gen)
    return x, torch.randint(0, 10, (args.batch_size,), generator=gen)


def reference_grads(args, ctx, x, y):
    """One process, whole model, whole batch: the gradients of this rank's layers."""
    model = whole_model(args).to(ctx.device)
    loss = cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
    loss.backward()
    mine = pipeline.split_model(model, ctx.world_size, ctx.rank)
    return [q.grad for q in mine.parameters()], loss.item()


def gather(obj, world_size):
    everyone = [None] * world_size
    dist.all_gather_object(everyone, obj)
    return everyone


def torch_pipelining(args, ctx, name, m, x, y, ours):
    """The same step with torch.distributed.pipelining, against ours on this rank.

    Returns the largest |gradient - ours| and the order in which torch's schedule ran
    this rank's forwards and backwards, as (kind, micro-batch) pairs. (None, None) for
    the naive split (torch has no such schedule), when m does not divide the batch
    (torch averages the micro-batch losses with equal weights) and with --no-torch.
    """
    if name == "naive" or len(x) % m or args.no_torch:
        return None, None
    # Imported here: it pulls in torch's compiler and DTensor, seconds per process.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    p, k = ctx.world_size, ctx.rank
    theirs = pipeline.split_model(whole_model(args), p, k).to(ctx.device)
    stage = PipelineStage(theirs, k, p, ctx.device)
    torch_schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    schedule = torch_schedule(stage, n_microbatches=m, loss_fn=cross_entropy)
    order = []  # the schedule calls the stage once per forward and backward of a micro-batch
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def logged_forward(i, *a, **kw):
        order.append(("F", i))
        return forward(i, *a, **kw)

    def logged_backward(i, *a, **kw):
        order.append(("B", i))
        return backward(i, *a, **kw)

    stage.forward_one_chunk, stage.backward_one_chunk = logged_forward, logged_backward
    if k == 0:
        schedule.step(x.to(ctx.device), **({"target": y.to(ctx.device)} if p == 1 else {}))
    elif k == p - 1:
        schedule.step(target=y.to(ctx.device))
    else:
        schedule.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    diff = max((a.grad - b.grad).abs().max().item()
               for a, b in zip(ours.parameters(), theirs.parameters()))
    return diff, order


def one_step(args, ctx, name, m, x, y, ref):
    """One pipelined step with schedule ``name`` and m micro-batches; what every rank saw."""
    p, k = ctx.world_size, ctx.rank
    stage = pipeline.split_model(whole_model(args), p, k).to(ctx.device)
    result = pipeline.run_schedule(
        pipeline.schedule(name, p, m), stage, k,
        inputs=pipeline.split_microbatches(x, m), targets=pipeline.split_microbatches(y, m),
        loss_fn=cross_entropy,
        forward_sleep_s=args.stage_cost_s, backward_sleep_s=2 * args.stage_cost_s,
    )
    ref_grads, ref_loss = ref
    for q, g in zip(stage.parameters(), ref_grads):
        torch.testing.assert_close(q.grad, g, rtol=1e-5, atol=1e-6)  # NEW: equal to one process
    diff = max((q.grad - g).abs().max().item() for q, g in zip(stage.parameters(), ref_grads))
    timeline = pipeline.gather_timeline(result).relative()
    torch_diff, torch_order = torch_pipelining(args, ctx, name, m, x, y, stage)
    ours = [(a.kind, a.microbatch) for a in pipeline.schedule(name, p, m)[k]]
    same_order = None if torch_order is None else torch_order == ours
    ranks = gather((result.peak_in_flight, result.bytes_sent, diff, torch_diff, same_order), p)
    loss = gather(result.loss, p)[-1]
    return {
        "schedule": name, "microbatches": m,
        "bubbles": timeline.bubbles(),
        "formula": pipeline.gpipe_bubble(p, 1 if name == "naive" else m),
        "makespan_s": timeline.makespan,
        "peak_in_flight": [r[0] for r in ranks],
        "bytes_sent": [r[1] for r in ranks],
        "grad_diff": max(r[2] for r in ranks),
        "torch_grad_diff": None if torch_diff is None else max(r[3] for r in ranks),
        "torch_same_order": [r[4] for r in ranks],  # per rank; None: no torch schedule
        "loss": loss, "loss_gap": abs(loss - ref_loss),
        "timeline": timeline.to_records(),
    }


def main_run(args):
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        x, y = whole_batch(args)
        ref = reference_grads(args, ctx, x, y)
        one_step(args, ctx, "gpipe", 1, x, y, ref)  # warm-up: first messages open connections
        runs = []
        for name in args.schedule:
            for m in args.microbatches:
                if name == "1f1b" and m < ctx.world_size:
                    log.info(f"1f1b p={ctx.world_size} m={m} skipped: 1F1B needs at least "
                             "as many micro-batches as stages")
                    continue
                run = one_step(args, ctx, name, m, x, y, ref)
                runs.append(run)
                log.info(f"{name:5s} p={ctx.world_size} m={m}: bubble per rank "
                         + " ".join(f"{b:.2f}" for b in run["bubbles"])
                         + f" (formula {run['formula']:.2f}), activations held "
                         f"{run['peak_in_flight']}, |grad - one process| <= "
                         f"{run['grad_diff']:.1e}")
                if run["torch_grad_diff"] is not None:
                    log.info(f"      torch.distributed.pipelining: |grad - ours| <= "
                             f"{run['torch_grad_diff']:.1e}")
        if not runs:
            raise SystemExit("nothing to run: give 1F1B at least as many micro-batches as ranks")
        write_results(ctx, args.results,
                      {"world_size": ctx.world_size, "device": str(ctx.device),
                       "stage_cost_s": args.stage_cost_s, "batch_size": args.batch_size,
                       "hidden": args.hidden, "layers": args.layers, "runs": runs})


def sweep(args):
    """Launch this script for every number of stages; one JSON with every run."""
    if "WORLD_SIZE" in os.environ:
        raise SystemExit("--sweep launches torchrun itself: run it with plain python")
    common = ["--batch-size", str(args.batch_size), "--hidden", str(args.hidden),
              "--layers", str(args.layers)]
    jobs = [(p, args.stage_cost_s, ["--microbatches", "1", "2", "4", "8"])
            for p in args.sweep_stages]
    # Real compute on 2 stages, wider layers so that compute outweighs messages.
    jobs.append((2, 0.0, ["--microbatches", "1", "2", "4", "8", "--hidden", "1024"]))
    out = {"jobs": []}
    for p, cost, extra in jobs:
        repeats = [
            launch.torchrun(__file__, [*common, *extra, "--stage-cost-s", str(cost)],
                            nproc=p, results=True, echo=False, timeout_s=600).results
            for _ in range(args.sweep_repeats if cost > 0 else 1)
        ]
        job = repeats[0]
        # Interference (other programs, a late wake-up) only ever adds idle time, so
        # for each schedule and m the repeat with the least idle is the best estimate
        # of the schedule's own bubble, as timeit keeps the fastest of its repeats.
        for i in range(len(job["runs"])):
            job["runs"][i] = min((r["runs"][i] for r in repeats), key=lambda r: max(r["bubbles"]))
        job["repeats"] = len(repeats)
        out["jobs"].append(job)
    out["load_average_1min_end"] = os.getloadavg()[0]
    write_results(None, args.results, out)  # meta: the load average when it began
    print(f"wrote {len(out['jobs'])} jobs to {os.path.relpath(args.results)}")


def main():
    args = parse_args()
    if args.sweep:
        if not args.results:
            raise SystemExit("--sweep needs --results PATH")
        sweep(args)
    else:
        main_run(args)


if __name__ == "__main__":
    main()
