"""Tensor parallelism: Megatron-LM's MLP split over ranks, from scratch and with DTensor.

Run from the repository root:
    python scripts/08_tensor_parallel.py
    torchrun --nproc_per_node=2 scripts/08_tensor_parallel.py
    torchrun --nproc_per_node=4 scripts/08_tensor_parallel.py --hidden 512

Every rank builds the same stack of MLP blocks (d_model -> hidden -> d_model)
and splits each block over all ranks: fc1 by its output features
(ColumnParallelLinear), fc2 by its input features (RowParallelLinear), with
Megatron-LM's f and g operators placing one all-reduce in forward and one in
backward per block. The script asserts that the output, the input gradient
and every weight gradient (the shards put back together) equal the whole
stack's in one process, and that PyTorch's parallelize_module with
ColwiseParallel/RowwiseParallel on a device mesh gives the same. It counts
the all-reduces of both with CommDebugMode and the bytes of ours with the
course's CollectiveLog, and writes them to --results (rank 0).
"""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.functional import mse_loss

from ddp_course import comm_cost
from ddp_course import tensor_parallel as tp
from ddp_course.harness.script_args import script_parser
from ddp_course.models import FeedForward
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.records import write_results


def parse_args():
    meaning = {"hidden": "hidden features (split over ranks)", "batch_size": "samples (not split)"}
    p = script_parser(__doc__, d_model=64, hidden=256, batch_size=32, results=None, help=meaning)
    p.add_argument("--blocks", type=int, default=2, help="MLP blocks in the stack")
    return p.parse_args()


def whole_stack(args):
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(*[FeedForward(args.d_model, args.hidden) for _ in range(args.blocks)])


def forward_backward(model, x, target):
    """Output, input gradient and CommDebugMode counts of forward and of backward."""
    x = x.clone().requires_grad_()
    with CommDebugMode() as fwd:
        out = model(x)
    with CommDebugMode() as bwd:
        mse_loss(out, target).backward()
    counts = {"forward": {str(k): v for k, v in fwd.get_comm_counts().items()},
              "backward": {str(k): v for k, v in bwd.get_comm_counts().items()}}
    return out, x.grad, counts


def gathered_grads(ours):
    """Whole gradients rebuilt from the shards (fc1 split by rows, fc2 by columns)."""
    grads = {}
    for i, block in enumerate(ours):
        grads[f"{i}.fc1.weight"] = tp.gather_shards(block.fc1.weight.grad, 0)
        grads[f"{i}.fc1.bias"] = tp.gather_shards(block.fc1.bias.grad, 0)
        grads[f"{i}.fc2.weight"] = tp.gather_shards(block.fc2.weight.grad, 1)
        grads[f"{i}.fc2.bias"] = block.fc2.bias.grad  # whole on every rank
    return grads


def max_diff(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return (a - b).abs().max().item()


def main():
    args = parse_args()
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        n, dev = ctx.world_size, ctx.device
        gen = torch.Generator().manual_seed(1)  # the same batch on every rank
        x = torch.randn(args.batch_size, args.d_model, generator=gen).to(dev)
        target = torch.randn(args.batch_size, args.d_model, generator=gen).to(dev)

        reference = whole_stack(args).to(dev)  # one process, whole weights
        ref_out, ref_xgrad, _ = forward_backward(reference, x, target)
        ref_grads = {name: q.grad for name, q in reference.named_parameters()}

        # NEW: each block split over the ranks, fc1 by columns of A, fc2 by rows of B.
        ours = nn.Sequential(
            *[tp.ParallelFeedForward(b, ctx.rank, n) for b in whole_stack(args)]
        ).to(dev)
        collectives = CollectiveLog()
        with collectives.recording():
            out, xgrad, our_counts = forward_backward(ours, x, target)
        calls = [c["bytes"] for c in collectives.calls if c["op"] == "all_reduce"]
        diffs = {"output": max_diff(out, ref_out), "input gradient": max_diff(xgrad, ref_xgrad)}
        got = gathered_grads(ours)
        diffs["weight gradients"] = max(max_diff(got[k], g) for k, g in ref_grads.items())

        # The same split by PyTorch: DTensor shards on a one-dimensional device mesh.
        mesh = init_device_mesh(dev.type, (n,))
        plan = {}
        for i in range(args.blocks):
            plan[f"{i}.fc1"], plan[f"{i}.fc2"] = ColwiseParallel(), RowwiseParallel()
        theirs = parallelize_module(whole_stack(args).to(dev), mesh, plan)
        t_out, t_xgrad, torch_counts = forward_backward(theirs, x, target)
        torch_diffs = {"output": max_diff(t_out, out), "input gradient": max_diff(t_xgrad, xgrad)}
        torch_diffs["weight gradients"] = max(
            max_diff(q.grad.full_tensor(), got[name]) for name, q in theirs.named_parameters()
        )

        payload = args.batch_size * args.d_model * 4  # one [batch, d_model] float32 tensor
        ring = comm_cost.ring_bytes(args.batch_size * args.d_model, 4, n, ctx.rank)
        result = {
            "world_size": n, "device": str(dev), "d_model": args.d_model, "hidden": args.hidden,
            "blocks": args.blocks, "batch_size": args.batch_size,
            "diffs": diffs, "torch_diffs": torch_diffs,
            "counts": {"ours": our_counts, "torch": torch_counts},
            "all_reduce_bytes": calls, "payload_bytes": payload,
            "ring_bytes_sent_per_all_reduce": ring.bytes_sent,
            "params_whole": sum(q.numel() for q in reference.parameters()),
            "params_per_rank": sum(q.numel() for q in ours.parameters()),
        }
        log.info(f"{n} ranks: |ours - one process| <= {max(diffs.values()):.1e}, "
                 f"|parallelize_module - ours| <= {max(torch_diffs.values()):.1e}; "
                 f"{len(calls)} all-reduces of {payload} bytes for {args.blocks} blocks; "
                 f"CommDebugMode, ours {our_counts}, torch {torch_counts}")
        write_results(ctx, args.results, result)


if __name__ == "__main__":
    main()
