"""Worker: what ``ddp_course.tools.collective_log.CollectiveLog`` sees, path by path.

Each case runs under ``log.recording(case)`` on a 2 x (world / 2) mesh ``("dp", "tp")``
and is also measured by something that does not use the dispatcher, so the test can
compare the two:

- the ``torch.distributed`` functions one by one (their tensors' sizes are known);
- DDP's bucket all-reduces: a communication hook counts the buckets and their bytes;
- FSDP2's all-gathers and reduce-scatters: PyTorch's ``CommDebugMode`` counts them, and
  their sizes follow from the parameters;
- DTensor's tensor parallelism: ``CommDebugMode`` counts its collectives;
- arithmetic without a collective: nothing logged; an all-reduce started on another
  thread: logged;
- collectives inside ``torch.compile``'d code: a compiled function's functional
  all-reduce (one graph compiled, not skipped for the log's sake: Dynamo's counters),
  and DDP's bucket all-reduces around a compiled module against the same model eager.

    torchrun --nproc_per_node=4 tests/workers/collective_log_check.py
"""

import threading

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import worker_checks  # tests/workers/, the script's folder
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.runtime import distributed
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results

args = worker_checks.parse_args()


def plain(ctx, log, out):
    n, rank = ctx.world_size, ctx.rank
    t = torch.ones(6, 4, dtype=torch.float64)  # 192 bytes
    with log.recording("all_reduce"):
        dist.all_reduce(t)
    with log.recording("all_gather"):
        dist.all_gather_into_tensor(torch.empty(6 * n, 4, dtype=torch.float64), t)
    with log.recording("reduce_scatter"):
        dist.reduce_scatter_tensor(
            torch.empty(6, 4, dtype=torch.float64), torch.ones(6 * n, 4, dtype=torch.float64)
        )
    # Uneven all-to-all: rank r sends r + 1 rows to every peer.
    splits = [rank + 1] * n
    receive = [peer + 1 for peer in range(n)]
    with log.recording("all_to_all"):
        dist.all_to_all_single(
            torch.empty(sum(receive), 4),
            torch.ones(sum(splits), 4),
            output_split_sizes=receive,
            input_split_sizes=splits,
        )
    with log.recording("broadcast"):
        dist.broadcast(t, src=0)
    # Rank 0 holds the N pieces; the others hold only their own, and the record is the
    # same on every rank.
    pieces = [torch.ones(6, 4, dtype=torch.float64) for _ in range(n)] if rank == 0 else None
    with log.recording("scatter"):
        dist.scatter(torch.empty(6, 4, dtype=torch.float64), pieces, src=0)
    with log.recording("gather"):
        dist.gather(t, pieces, dst=0)
    with log.recording("p2p"):
        ops = [
            dist.P2POp(dist.isend, t, (rank + 1) % n),
            dist.P2POp(dist.irecv, torch.empty_like(t), (rank - 1) % n),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    with log.recording("functional"):
        funcol.all_reduce(t, "sum", dist.group.WORLD).wait()
    with log.recording("no collective"):
        (t @ t.T).sum()
    # A communication hook's callback may run on another thread: still logged.
    with log.recording("other thread"):
        worker = threading.Thread(target=dist.all_reduce, args=(torch.ones(3),))
        worker.start()
        worker.join()
    out["expected"] = {"all_to_all_sent": (n - 1) * (rank + 1) * 4 * 4}


def ddp(ctx, log, out):
    """The reducer's own bucket all-reduces (C++), beside a hook that sees the same buckets."""
    seen, ddp_calls = [], []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        work = dist.all_reduce(bucket.buffer().div_(ctx.world_size), async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    for phase in ("ddp hook", "ddp"):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), bucket_cap_mb=0.01)
        if phase == "ddp hook":
            model.register_comm_hook(None, hook)
        model(torch.randn(4, 64)).sum().backward()  # the first step builds the buckets
        seen.clear()
        with log.recording(phase):
            model(torch.randn(4, 64)).sum().backward()
        ddp_calls.append(list(seen))
    out["ddp_hook_bytes"] = ddp_calls[0]  # the builtin phase runs no hook


def fsdp(ctx, mesh, log, out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    # Each unit's parameters, flattened: what FSDP2 gathers and reduce-scatters (72 floats
    # divide evenly by the shard count, so no padding).
    out["fsdp_unit_bytes"] = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model]
    for layer in model:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    with log.recording("fsdp"), CommDebugMode() as debug:
        model(torch.randn(2, 8)).sum().backward()
    out["fsdp_comm_debug"] = {str(k): v for k, v in debug.get_comm_counts().items()}


def tensor_parallel(ctx, mesh, log, out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    with log.recording("tp"), CommDebugMode() as debug:
        model(torch.randn(2, 8)).sum().backward()
    out["tp_comm_debug"] = {str(k): v for k, v in debug.get_comm_counts().items()}


def compiled(ctx, mesh, log, out):
    """Collectives that run inside compiled graphs, logged while the graphs stay compiled."""
    group = mesh["tp"].get_group()

    def step(x):
        return funcol.all_reduce(x * 2, "sum", group) + 1

    aot_eager = lookup_backend("aot_eager")
    stats = torch._dynamo.utils.counters["stats"]
    torch._dynamo.reset()
    before = stats["unique_graphs"]
    fn = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.ones(6, 4, dtype=torch.float64)  # 192 bytes
    with log.recording("compiled function"):
        y = fn(x)  # compiled on this first call, with the log off while Dynamo traces
        fn(x)  # the compiled graph again
    out["compiled_graphs"] = stats["unique_graphs"] - before
    out["compiled_value"] = y[0, 0].item()

    # DDP around a compiled module (torchtitan's order: compile, then wrap): the module's
    # forward and backward run as compiled graphs, DDP's reducer all-reduces its buckets.
    graphs = []  # what the backend is handed

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)])  # 1 MiB each
    group = mesh["dp"].get_group()
    compiled_model = DDP(
        torch.compile(layers, backend=counting_backend), process_group=group, bucket_cap_mb=1
    )
    torch.manual_seed(0)
    eager_model = DDP(
        nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)]),
        process_group=group,
        bucket_cap_mb=1,
    )
    x = torch.randn(2, 512)
    # The first step compiles and builds the buckets; the second rebuilds them in the
    # order the gradients came (rank 0 broadcasts the order: two int32 tensors).
    for _ in range(2):
        compiled_model(x).sum().backward()
        eager_model(x).sum().backward()
    for phase, run in (("ddp compiled", compiled_model), ("ddp eager", eager_model)):
        with log.recording(phase):
            run(x).sum().backward()
    out["ddp_compiled_graphs"] = len(graphs)


with distributed(device="cpu") as ctx:
    mesh = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("dp", "tp"))
    log = CollectiveLog(mesh)
    out = {"world_size": ctx.world_size, "rank": ctx.rank}
    plain(ctx, log, out)
    ddp(ctx, log, out)
    fsdp(ctx, mesh, log, out)
    tensor_parallel(ctx, mesh, log, out)
    compiled(ctx, mesh, log, out)
    out["calls"] = log.calls
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, out)
    write_results(ctx, args.results, {"world_size": ctx.world_size, "ranks": everyone})
