"""torch's sharding: ZeroRedundancyOptimizer and FSDP2 against DDP, and sharded checkpoints.

Run from the repository root:
    python scripts/09_fsdp.py
    torchrun --nproc_per_node=2 scripts/09_fsdp.py --checkpoint build/09_ckpt
    torchrun --nproc_per_node=3 scripts/09_fsdp.py --resume build/09_ckpt

Every rank trains the same MLP with Adam on its slice of the same batches four
ways, from the same start: torch's DDP (the reference), DDP with
ZeroRedundancyOptimizer, and FSDP2 (fully_shard on each Linear and on the
whole model, over a device mesh of every rank) with reshard_after_forward
True and False. Losses and final parameters must equal DDP's (assert_close);
FSDP2 whose ranks start from different weights (no broadcast) does not.
Each rank reports the bytes of parameters, gradients and optimizer state it
holds after a step (local shards only), the all-gathers one step makes, the
bytes of every collective of that step as torch's dispatcher saw them
(ddp_course.tools.zero_counts.CollectiveBytes) and the full-parameter bytes alive
between forward and backward; on GPU also torch.cuda.max_memory_allocated.

--checkpoint DIR: after training, the FSDP2 model and its Adam state are
gathered to rank 0 as a plain state dict (DIR/full.pt) and saved sharded with
torch.distributed.checkpoint (DIR/sharded/, one file per rank), then loaded
back into a fresh model as below, at the same world size.
--resume DIR: a fresh FSDP2 model and optimizer, at this job's world size,
load DIR/sharded/; gathered to rank 0 they must equal DIR/full.pt.
--prefetch: FSDP2 (reshard_after_forward=True) once more, with and without explicit
prefetching (set_modules_to_forward_prefetch, set_modules_to_backward_prefetch):
the order of its collectives and of the units' forward and backward
(ddp_course.tools.fsdp_units.UnitOrder), and parameters equal bit for bit.
--meta-init: FSDP2 built on the meta device, sharded, allocated with to_empty and
loaded from rank 0's full state dict (broadcast_from_rank0); the bytes each rank
holds on the way; equal to the model built normally, before and after training.
"""

import argparse
import pathlib
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.data import synthetic_classification
from ddp_course.models import MLP
from ddp_course.runtime import distributed, get_logger, no_tf32, pick_backend, pick_device
from ddp_course.sharding import FP32_ADAM, state_bytes_per_rank
from ddp_course.tools.collective_log import CollectiveLog
from ddp_course.tools.fsdp_units import UnitOrder, parameter_storage_bytes
from ddp_course.tools.records import write_results
from ddp_course.tools.zero_counts import CollectiveBytes, held_bytes

# CommDebugMode's module tracker uses full backward hooks, which warn on the first layer.
warnings.filterwarnings("ignore", message="Full backward hook is firing")
# fully_shard warns that the root's output is a view (of the last layer's output): harmless
# here, nothing modifies the logits in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3,
                   help="Adam steps per variant; the last one's traffic is reported")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP's hidden layers")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--checkpoint", help="save the FSDP2 model and optimizer in this folder")
    p.add_argument("--resume", help="load a folder written by --checkpoint and compare")
    p.add_argument("--prefetch", action="store_true",
                   help="FSDP2 with and without explicit prefetching, compared")
    p.add_argument("--meta-init", action="store_true",
                   help="FSDP2 built on the meta device and loaded from rank 0")
    p.add_argument("--results", help="write the measurements here as JSON (rank 0)")
    return p.parse_args()


def make_model(args, seed, ctx):
    torch.manual_seed(seed)
    return MLP(hidden=args.hidden).to(ctx.device)


def shard_model(model, mesh, reshard_after_forward):
    """FSDP2: each Linear is one unit (all-gathered on its own), then the root."""
    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def full_parameters(model):
    """A copy of every full parameter by name (DTensors all-gathered: call on every rank).

    A copy: with one rank ``full_tensor()`` can share the sharded parameter's
    memory, and a later load into the model would change the "before" values."""
    out = {}
    for name, p in model.named_parameters():
        out[name.removeprefix("module.")] = (
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        )
    return out


def unsharded_bytes(model):
    """Bytes of full (not DTensor) parameters with storage right now."""
    return sum(p.untyped_storage().nbytes() for p in model.parameters()
               if not isinstance(p, DTensor))


def all_gathers(counts):
    return sum(v for k, v in counts.items() if "all_gather" in str(k) or "allgather" in str(k))


def train(args, kind, batches, ctx, mesh, fsdp_seed=0, model=None):
    """One variant for args.steps steps; returns the model, optimizer and measurements.

    model: an FSDP2 model built by the caller, trained as it is."""
    if model is None and kind in ("DDP", "ZeroRedundancyOptimizer"):
        # Ranks start elsewhere on purpose: DDP broadcasts rank 0's weights.
        model = DDP(make_model(args, ctx.rank, ctx))
    elif model is None:
        # NEW: fully_shard broadcasts nothing, each rank keeps its slice of its own
        # weights: every rank must build the same model (same seed) or load a checkpoint.
        model = shard_model(make_model(args, fsdp_seed, ctx), mesh,
                            reshard_after_forward=kind.endswith("True"))
    if kind == "ZeroRedundancyOptimizer":
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=args.lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    b, losses = args.batch_size, []
    for x, y in batches:
        opt.zero_grad()
        # Forward too: FSDP2 all-gathers there, and DDP's second forward broadcasts its
        # rebuilt bucket order (once: from the third step on, a step is a steady one).
        with CommDebugMode() as comm, CollectiveBytes() as sent:
            loss = F.cross_entropy(model(x[ctx.rank * b : (ctx.rank + 1) * b]),
                                   y[ctx.rank * b : (ctx.rank + 1) * b])
            between = unsharded_bytes(model)  # full parameters kept for backward
            loss.backward()
            opt.step()
        # The loss of the whole global batch: the mean of the ranks' means.
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    inner = model.module if isinstance(model, DDP) else model
    optimizer = opt.optim if kind == "ZeroRedundancyOptimizer" else opt
    measured = {
        "losses": losses,
        "held": held_bytes(inner, optimizer).__dict__,
        "all_gathers_per_step": all_gathers(comm.get_comm_counts()),
        # the last step's collectives, bytes by op and in the ZeRO paper's units
        "sent_by_op": {op: sent.bytes_of(op) for op, _ in sent.calls},
        "sent_bytes": sent.volume_bytes,
        "unsharded_bytes_after_forward": between,
        "cuda_peak_bytes": (torch.cuda.max_memory_allocated(ctx.device)
                            if ctx.device.type == "cuda" else None),
    }
    return model, opt, measured


def full_state(model, opt):
    """Model and optimizer state dicts gathered to rank 0, on CPU (empty on other ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, opt, options=options)}


def save_checkpoint(folder, model, opt, ctx):
    full = full_state(model, opt)
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(full, folder / "full.pt")  # a plain state dict: loads without FSDP
    model_sd, optim_sd = get_state_dict(model, opt)  # this rank's shards (DTensors)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / "sharded")
    files = sorted(p.name for p in (folder / "sharded").iterdir())
    return {"saved_world_size": ctx.world_size, "files": files}


class RecordingLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, noting which saved pieces this rank reads from."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        # (name, first row of the saved piece) for every piece this rank's plan reads from
        self.pieces = sorted({(item.storage_index.fqn, item.storage_index.offset[0])
                              for item in plan.items if item.storage_index.offset})
        return plan


def resume_checkpoint(args, folder, ctx, mesh):
    """Load the sharded checkpoint at this world size; compare with the gathered copy."""
    model = shard_model(make_model(args, 100 + ctx.rank, ctx), mesh, True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    before = full_parameters(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    planner = RecordingLoadPlanner()
    dcp.load(state, checkpoint_id=folder / "sharded", planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, opt)
    out = {"world_size": ctx.world_size, "local_numel": {}}
    for name, p in model.named_parameters():
        out["local_numel"][name] = p.to_local().numel()
    if ctx.is_main:
        saved = torch.load(folder / "full.pt", weights_only=True)
        # Bit for bit: parameters, Adam's moments and step counters, and the hyperparameters.
        torch.testing.assert_close(got["model"], saved["model"], rtol=0, atol=0)
        torch.testing.assert_close(got["optim"]["state"], saved["optim"]["state"], rtol=0, atol=0)
        assert got["optim"]["param_groups"] == saved["optim"]["param_groups"]
        changed = max((before[k] - got["model"][k].to(ctx.device)).abs().max().item()
                      for k in before)
        out["changed_by_load"] = changed  # the fresh model was elsewhere: > 0
        out["optim_steps"] = sorted({float(s["step"]) for s in got["optim"]["state"].values()})
    # The model's saved pieces (first row, rows), and the ones each rank read from.
    meta = dcp.FileSystemReader(folder / "sharded").read_metadata().state_dict_metadata
    prefix = "model."
    out["saved_pieces"] = {fqn[len(prefix):]: sorted((c.offsets[0], c.sizes[0]) for c in m.chunks)
                           for fqn, m in meta.items() if fqn.startswith(prefix)}
    read = {}
    for fqn, row in planner.pieces:
        if fqn.startswith(prefix):
            read.setdefault(fqn[len(prefix) :], []).append(row)
    out["read_pieces"] = read
    for key in ("local_numel", "read_pieces"):  # every rank's, for rank 0 to write
        per_rank = [None] * ctx.world_size
        dist.all_gather_object(per_rank, out[key])
        out[key] = per_rank
    return out


def units_of(model):
    """The MLP's FSDP2 units by name: its Linear layers, in forward order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def set_prefetch(model):
    """NEW: explicit prefetching. In forward each unit all-gathers the next one right after
    its own; in backward the last unit all-gathers every unit before it, nearest first."""
    units = list(units_of(model).values())
    for unit, after in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([after])
    units[-1].set_modules_to_backward_prefetch(units[-2::-1])


def prefetch_runs(args, batches, ctx, mesh):
    """FSDP2 (reshard_after_forward=True) without and with explicit prefetching, in order."""
    out, params = {}, {}
    for prefetch in (False, True):
        model = shard_model(make_model(args, 0, ctx), mesh, reshard_after_forward=True)
        if prefetch:
            set_prefetch(model)
        order = UnitOrder(units_of(model))
        with order.recording():
            model, _, measured = train(args, f"prefetch={prefetch}", batches, ctx, mesh,
                                       model=model)
        params[prefetch] = full_parameters(model)
        out[prefetch] = {"events": order.events, "losses": measured["losses"]}
    # Prefetching changes when a unit is gathered, not what is computed: bit for bit.
    torch.testing.assert_close(params[True], params[False], rtol=0, atol=0)
    return {"without": out[False], "with": out[True], "units": list(units_of(model)),
            "gap": max((params[True][k] - params[False][k]).abs().max().item()
                       for k in params[False])}


def meta_init(args, batches, ctx, mesh, trained_normally):
    """FSDP2 built on meta, sharded, allocated, loaded from rank 0: bytes held on the way,
    equal to the model built normally before training and (trained_normally) after."""
    normal = make_model(args, 0, ctx)
    held = {"normal: built": parameter_storage_bytes(normal)}
    reference = full_parameters(normal)  # built normally, in this process alone
    shard_model(normal, mesh, reshard_after_forward=True)
    held["normal: fully_shard"] = parameter_storage_bytes(normal)
    with torch.device("meta"):  # NEW: shapes and dtypes, no memory
        model = MLP(hidden=args.hidden)
    held["meta: built"] = parameter_storage_bytes(model)
    shard_model(model, mesh, reshard_after_forward=True)
    held["meta: fully_shard"] = parameter_storage_bytes(model)
    model.to_empty(device=ctx.device)  # NEW: this rank's shards, not initialised yet
    held["meta: to_empty"] = parameter_storage_bytes(model)
    # NEW: rank 0 alone holds the whole model (built here; in practice loaded from a file);
    # it sends one tensor at a time, each rank keeps its rows.
    full = make_model(args, 0, ctx).state_dict() if ctx.is_main else {}
    held["meta: full state dict"] = sum(t.numel() * t.element_size() for t in full.values())
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    loading = CollectiveLog()
    with loading.recording():
        set_model_state_dict(model, full, options=options)
    del full
    held["meta: loaded"] = parameter_storage_bytes(model)
    loaded = full_parameters(model)
    torch.testing.assert_close(loaded, reference, rtol=0, atol=0)  # rank 0's model, everywhere
    model, _, measured = train(args, "meta init", batches, ctx, mesh, model=model)
    trained = full_parameters(model)
    torch.testing.assert_close(trained, trained_normally, rtol=0, atol=0)
    return {"held": held, "losses": measured["losses"],
            "broadcasts": [(c["dtype"], c["shape"], c["bytes"]) for c in loading.calls],
            "loaded_gap": max((loaded[k] - reference[k]).abs().max().item() for k in reference),
            "trained_gap": max((trained[k] - trained_normally[k]).abs().max().item()
                               for k in trained)}


def main():
    args = parse_args()
    # One plain process on a GPU gets an nccl group of one, as torchrun's ranks would:
    # the collectives run on the device's tensors.
    with distributed(backend=pick_backend(pick_device()), group_of_one=True) as ctx:
        no_tf32()  # every variant compared with DDP to float32 rounding, also on a GPU
        log = get_logger(ctx)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        results = {"world_size": ctx.world_size, "device": ctx.device.type}
        if args.resume:
            results["resume"] = resume_checkpoint(args, pathlib.Path(args.resume), ctx, mesh)
            log.info(f"loaded {args.resume} at world size {ctx.world_size}: "
                     "equal to the gathered full state dict")
        else:
            n, b = ctx.world_size, args.batch_size
            x, y = synthetic_classification(args.steps * n * b).tensors
            batches = [(x[i * n * b : (i + 1) * n * b].to(ctx.device),
                        y[i * n * b : (i + 1) * n * b].to(ctx.device))
                       for i in range(args.steps)]
            kinds = ["DDP", "ZeroRedundancyOptimizer", "FSDP2 reshard_after_forward=True",
                     "FSDP2 reshard_after_forward=False"]
            variants, reference = {}, None
            for kind in kinds:
                model, opt, measured = train(args, kind, batches, ctx, mesh)
                params = full_parameters(model)
                if reference is None:
                    reference = params
                torch.testing.assert_close(params, reference)  # the claim: same as DDP
                measured["gap"] = max((params[k] - reference[k]).abs().max().item()
                                      for k in reference)
                per_rank = [None] * n
                dist.all_gather_object(per_rank, measured)
                variants[kind] = per_rank
                if kind == kinds[2]:
                    fsdp_params = params  # reshard_after_forward=True, built normally
                log.info(f"{kind:34s} losses {[round(v, 4) for v in measured['losses']]}, "
                         f"|param - DDP| {measured['gap']:.1e}, rank 0 holds "
                         f"{sum(measured['held'].values()) / 1e6:.3f} MB, "
                         f"sent {measured['sent_bytes'] / 1e6:.3f} MB in a step")
            if args.prefetch:
                results["prefetch"] = prefetch_runs(args, batches, ctx, mesh)
                log.info(f"FSDP2 with explicit prefetching: |param - without| "
                         f"{results['prefetch']['gap']:.1e}")
            if args.meta_init:
                meta = meta_init(args, batches, ctx, mesh, fsdp_params)
                per_rank = [None] * n
                dist.all_gather_object(per_rank, meta)
                results["meta_init"] = per_rank
                log.info(f"FSDP2 built on meta, loaded from rank 0: |param - built normally| "
                         f"{meta['loaded_gap']:.1e}, after training "
                         f"{meta['trained_gap']:.1e}")
            # What the same seed is for: FSDP2 with each rank's own start trains a mix.
            mixed, _, _ = train(args, kinds[2], batches, ctx, mesh, fsdp_seed=ctx.rank)
            mixed = full_parameters(mixed)
            results["unbroadcast_gap"] = max((mixed[k] - reference[k]).abs().max().item()
                                             for k in reference)
            log.info(f"FSDP2 started from each rank's own weights: |param - DDP| "
                     f"{results['unbroadcast_gap']:.1e}")
            num_params = sum(p.numel() for p in reference.values())
            results.update(variants=variants, num_params=num_params,
                           param_tensors=len(reference),
                           formula={s: state_bytes_per_rank(s, num_params, n, FP32_ADAM).__dict__
                                    for s in (0, 1, 3)})
            if args.checkpoint:
                results["checkpoint"] = save_checkpoint(pathlib.Path(args.checkpoint),
                                                        model, opt, ctx)
                log.info(f"saved {args.checkpoint}: full.pt (rank 0) and sharded/ "
                         f"{results['checkpoint']['files']}")
                # Loaded back at the same world size, into a fresh model, in this job.
                folder = pathlib.Path(args.checkpoint)
                results["reload"] = resume_checkpoint(args, folder, ctx, mesh)
                log.info(f"loaded it back at world size {ctx.world_size}: equal")
        write_results(ctx, args.results, results)


if __name__ == "__main__":
    main()
