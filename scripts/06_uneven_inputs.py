"""Lesson 06: uneven inputs hang DDP; the Join context manager fixes it.

    torchrun --nproc_per_node=2 scripts/06_uneven_inputs.py --timeout-s 5  # times out
    torchrun --nproc_per_node=2 scripts/06_uneven_inputs.py --join --results 06_join.json
    python scripts/06_uneven_inputs.py  # one rank: nothing is uneven

Rank r trains on `batches + r * extra` batches, as when each rank reads a
shard of its own and the shards differ in size. DDP's backward pass is a
collective (an all-reduce of the gradients): once the rank with fewer
batches leaves the loop, its peer's all-reduce waits for it forever, while
it waits for its peer to finish. It waits through torchrun's key-value
store, not with a collective: a barrier or an all-reduce here would meet the
peer's gradient all-reduce, a collective of another size, which gloo lets
time out or stops on a size mismatch, and nccl leaves undefined. --timeout-s
turns the wait into an error: gloo raises it in the waiting call, nccl's
watchdog reports it and takes the process down. Under Join, a rank that ran
out of data shadows the others' all-reduces with zeros until every rank is
done, then the final model is broadcast from the last rank to finish (RFC pytorch#38174;
https://pytorch.org/tutorials/advanced/generic_join.html).
"""

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from ddp_course.data import synthetic_classification
from ddp_course.harness.restarts import attempt_prefix
from ddp_course.harness.script_args import script_parser
from ddp_course.models import MLP
from ddp_course.runtime import (
    DistContext,
    distributed,
    get_logger,
    seed_everything,
)
from ddp_course.tools.records import write_results


def wait_for_every_rank(ctx: DistContext, timeout_s: float) -> None:
    """Return once every rank has called this, or raise ``DistStoreError`` after
    ``timeout_s`` seconds. Counts the ranks in torchrun's store
    (``MASTER_ADDR:MASTER_PORT``), a key-value server: no collective, so it
    cannot be mistaken for a peer's gradient all-reduce."""
    timeout = datetime.timedelta(seconds=timeout_s)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    key = f"{attempt_prefix()}/06_uneven_inputs/finished"
    if store.add(key, 1) == ctx.world_size:  # the last rank to finish
        store.set(key + "/all", "yes")
    store.wait([key + "/all"])


def main() -> None:
    parser = script_parser(__doc__, batch_size=32, timeout_s=60, seed=0, results=None)
    parser.add_argument("--batches", type=int, default=4, help="batches on rank 0")
    parser.add_argument("--extra", type=int, default=2, help="more batches per higher rank")
    parser.add_argument("--join", action="store_true", help="train inside Join([model])")
    args = parser.parse_args()

    with distributed(timeout_s=args.timeout_s) as ctx:
        log = get_logger(ctx)
        seed_everything(args.seed)
        data = synthetic_classification(64 * args.batch_size, seed=args.seed)
        num_batches = args.batches + ctx.rank * args.extra
        start = ctx.rank * 16 * args.batch_size
        shard = Subset(data, range(start, start + num_batches * args.batch_size))
        model = MLP().to(ctx.device)
        if ctx.is_distributed:
            model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        log.info(f"rank r has {args.batches} + r*{args.extra} batches; join={args.join}")

        steps = 0
        # NEW: Join makes a rank that ran out of data answer its peers' all-reduces.
        # (One process has no DDP model to join, and nothing to wait for.)
        join = Join([model], enable=args.join) if ctx.is_distributed else contextlib.nullcontext()
        with join:
            for x, y in DataLoader(shard, batch_size=args.batch_size):
                x, y = x.to(ctx.device), y.to(ctx.device)
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                steps += 1
        log.warning(f"left the training loop after {steps} steps")
        if ctx.device.type == "cuda":
            # nccl's calls return before the GPU has done the work: wait for it
            # here, so that a rank whose all-reduce is stuck stops here.
            torch.cuda.synchronize(ctx.device)
        log.warning(f"finished its {steps} steps")
        if ctx.is_distributed:
            # Three timeouts: a peer stuck in an all-reduce times out first.
            wait_for_every_rank(ctx, 3 * args.timeout_s)

        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        per_rank = [None] * ctx.world_size if ctx.is_distributed else [None]
        if ctx.is_distributed:
            dist.all_gather_object(per_rank, {"steps": steps, "checksum": checksum})
        else:
            per_rank = [{"steps": steps, "checksum": checksum}]
        log.info(
            f"steps per rank {[r['steps'] for r in per_rank]}, parameter checksums "
            f"{[round(r['checksum'], 6) for r in per_rank]}"
        )
        write_results(
            ctx, args.results, {"world_size": ctx.world_size, "join": args.join, "ranks": per_rank}
        )


if __name__ == "__main__":
    main()
