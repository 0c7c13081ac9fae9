"""Asynchronous checkpoints: how long a save blocks training, and what a crash mid-save leaves.

Run from the repository root:
    python scripts/17_async_checkpoint.py
    torchrun --nproc_per_node=2 scripts/17_async_checkpoint.py --folder build/17_ft/ckpt
    torchrun --nproc_per_node=2 scripts/17_async_checkpoint.py --part crash
    torchrun --nproc_per_node=2 scripts/17_async_checkpoint.py --part load

The state is a TinyGPT (--d-model, --n-heads, --n-layers, --seq-len) and its AdamW optimizer
after --steps steps of DDP on the Shakespeare bytes, as
torch.distributed.checkpoint.state_dict.get_state_dict returns it: {"model": name -> tensor,
"optim": {"state": ..., "param_groups": ...}}. Every rank holds the same replica.

Part "time": --repeats times each, the seconds dcp.save blocks the training loop (it returns
when the checkpoint is written), against the seconds dcp.async_save blocks before it returns
and the seconds from then until its future completes (future.result()), each the slowest
rank's; each save to a sub-folder of its own under FOLDER/time (the first of each kind is
kept, the others removed). async_save's default staging (torch 2.13: a DefaultStager with
StagingOptions(False, False, False, False)) copies every tensor of the state into new CPU
memory on the calling thread, neither pinned nor shared, and returns once the copy is done;
a thread then plans and writes the copy (the default AsyncCheckpointerType.THREAD) and
completes the future. The copy, another state's worth of bytes, lives until the write ends.
Then one more async_save, between a step's backward and its optimizer step, so that AdamW
changes every tensor of the state in place as soon as the call returns, followed by
--steps-during training steps: when the update and each step began and ended and when the
write completed (seconds after the call), and the checkpoint, loaded back into a fresh model
and optimizer, compared tensor by tensor (torch.equal) with the state at the call, after the
update and after the steps, on every rank. With --stager none (the lab), that save copies nothing:
the writing thread reads the live tensors while the loop changes them. Also: the bytes of the
state's tensors and of each checkpoint on disk, the files, and two checkpoints loaded back.

Part "crash": checkpoint 1 (FOLDER/crash/step_1) is saved and waited for; rank 0 then writes
the SHA-256 of its tensors beside it (FOLDER/crash/step_1.json). After --steps more steps,
async_save starts checkpoint 2, and rank 0 kills itself with SIGKILL as soon as the call
returns, before the background write can finish. The other ranks' writes then fail (they need
rank 0 to gather the plans and write the metadata) and torchrun's agent stops them. The job
fails: that is the point.

Part "load", a new job: dcp.load of each checkpoint into a fresh model and optimizer (another
seed), reporting whether it loaded or the exception (type and first line; for a
CheckpointException, which is a BaseException and not an Exception, also each rank's cause);
for a checkpoint with a SHA-256 beside it, whether the loaded state matches it on every rank.
Also the files each checkpoint folder holds.

dcp.save and dcp.async_save run their collectives (gathering the plans, then the metadata) on
a gloo group of their own: the background write's collectives must not interleave with the
training loop's DDP all-reduces on the default group, and async_save needs a CPU backend.

PyTorch documents async_save in https://pytorch.org/docs/stable/distributed.checkpoint.html
and https://pytorch.org/tutorials/recipes/distributed_async_checkpoint_recipe.html.
Paths in the results are relative to --folder. Rank 0 writes --results.
"""

import json
import logging
import os
import pathlib
import shutil
import signal
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.harness.script_args import script_parser
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.runtime import distributed, get_logger
from ddp_course.tools.debug import state_digest
from ddp_course.tools.records import write_results

STOPPED_WITHIN_S = 60  # seconds a surviving rank of the crash waits for torchrun to stop it


def parse_args():
    meaning = {"batch_size": "sequences per rank per step",
               "steps": "AdamW steps before each checkpoint", "lr": "AdamW's learning rate"}
    p = script_parser(__doc__, d_model=256, n_heads=4, n_layers=6, seq_len=32, batch_size=2,
                      steps=2, lr=1e-3, seed=0, results=None, help=meaning)
    p.add_argument("--folder", default="build/17_ft/ckpt",
                   help="where the checkpoints go, one sub-folder per part")
    p.add_argument("--part", choices=("time", "crash", "load"), default="time",
                   help="what to run; crash ends the job with SIGKILL on rank 0")
    p.add_argument("--repeats", type=int, default=5, help="timed saves of each kind")
    p.add_argument("--steps-during", type=int, default=3,
                   help="training steps right after the async_save that is loaded back")
    p.add_argument("--stager", choices=("default", "none"), default="default",
                   help="staging of the async_save loaded back: a copy, or none (the lab)")
    return p.parse_args()


def batches(args, device, seed):
    """Endless language-model batches of the Shakespeare bytes on ``device``, seeded."""
    tokens = shakespeare_bytes("train")
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield tuple(t.to(device) for t in lm_batch(tokens, args.batch_size, args.seq_len, gen))


class Trainer:
    """A TinyGPT, its AdamW and its batches: the state a checkpoint holds."""

    def __init__(self, args, ctx, seed):
        torch.manual_seed(seed)
        self.model = TinyGPT(d_model=args.d_model, n_heads=args.n_heads,
                             n_layers=args.n_layers, seq_len=args.seq_len).to(ctx.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.ddp = DDP(self.model) if ctx.world_size > 1 else self.model
        self.batches = batches(args, ctx.device, seed + 1 + ctx.rank)  # each rank its own

    def backward(self):
        x, y = next(self.batches)
        lm_loss(self.ddp(x), y).backward()

    def update(self):
        """AdamW's step: every parameter and moment changes in place."""
        self.opt.step()
        self.opt.zero_grad()

    def step(self):
        self.backward()
        self.update()

    def state(self):
        """The live state: its tensors are the model's and the optimizer's own."""
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load(self, path, group):
        """dcp.load into this trainer's state, then hand it to the model and optimizer."""
        state = self.state()
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


class NoCopy(AsyncStager):
    """The lab's stager: it hands the live state to the writing thread and copies nothing."""

    _synchronize_after_execute = False  # nothing to wait for

    def stage(self, state_dict):
        return state_dict


def tensors(tree, prefix=""):
    """Every tensor of a nested state dict, ``{"optim/state/head.weight/exp_avg": t}``."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out = {}
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[path] = value
        elif isinstance(value, (dict, list, tuple)):
            out.update(tensors(value, path + "/"))
    return out


def snapshot(state):
    return {k: t.detach().clone() for k, t in tensors(state).items()}


def described(exc):
    """An exception's type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def equal_count(a, b):
    return sum(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def state_bytes(state):
    return sum(t.numel() * t.element_size() for t in tensors(state).values())


def files(folder):
    """The files under ``folder``: names relative to it, with their bytes."""
    return {str(p.relative_to(folder)): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file()}


def every_rank(value, ctx, group):
    """``value`` as each rank has it, in rank order."""
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value, group=group)
    return out


def slowest(values, ctx, group):
    """Each of ``values`` (seconds) as the slowest rank measured it."""
    return [max(v) for v in zip(*every_rank(values, ctx, group))]


def fresh_folder(folder, ctx, group):
    if ctx.is_main:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    dist.barrier(group=group)


def time_saves(args, ctx, group, root):
    """Part "time": blocked and background seconds of both saves, then a save under training."""
    folder = root / "time"
    fresh_folder(folder, ctx, group)
    trainer = Trainer(args, ctx, args.seed)
    for _ in range(args.steps):
        trainer.step()  # AdamW's moments exist only after a first step
    state = trainer.state()
    reps = []
    for rep in range(args.repeats):
        dist.barrier(group=group)  # every rank starts each save together
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=folder / f"sync_{rep}", process_group=group)
        sync_s = time.perf_counter() - start
        dist.barrier(group=group)
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=folder / f"async_{rep}", process_group=group)
        returned = time.perf_counter()
        future.result()
        done = time.perf_counter()
        reps.append(slowest([sync_s, returned - start, done - returned], ctx, group))
    loads = {}
    for name in ("sync_0", "async_0"):
        other = Trainer(args, ctx, args.seed + 1)
        before = equal_count(snapshot(state), snapshot(other.state()))
        other.load(folder / name, group)
        after = equal_count(snapshot(state), snapshot(other.state()))
        loads[name] = {"before": every_rank(before, ctx, group),
                       "after": every_rank(after, ctx, group)}
    if ctx.is_main:  # the first of each kind is kept to look at; the disk need not hold all
        for rep in range(1, args.repeats):
            for kind in ("sync", "async"):
                shutil.rmtree(folder / f"{kind}_{rep}")

    # The save comes between a step's backward and its update, so the state changes in
    # place at once after async_save returns: the write's hardest case.
    trainer.backward()
    state = trainer.state()
    at_call = snapshot(state)
    dist.barrier(group=group)
    written = []
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=folder / "during", process_group=group,
                            async_stager=NoCopy() if args.stager == "none" else None)
    returned_s = time.perf_counter() - start
    # The callback runs on the writing thread as the write completes (or here, if it has).
    future.add_done_callback(lambda f: written.append(time.perf_counter() - start))
    trainer.update()
    update_s = (returned_s, time.perf_counter() - start)
    after_update = snapshot(trainer.state())  # for the comparison, not part of training
    snapshot_s = (update_s[1], time.perf_counter() - start)
    steps_s = []
    for _ in range(args.steps_during):
        began = time.perf_counter() - start
        trainer.step()
        steps_s.append((began, time.perf_counter() - start))
    future.result()
    later = snapshot(trainer.state())
    loaded = Trainer(args, ctx, args.seed + 1)
    loaded.load(folder / "during", group)
    loaded = snapshot(loaded.state())
    dist.barrier(group=group)
    sizes = {name: sum(files(folder / name).values())
             for name in ("sync_0", "async_0", "during")}
    return {
        "sync_s": [r[0] for r in reps], "async_blocked_s": [r[1] for r in reps],
        "async_background_s": [r[2] for r in reps],
        "median_sync_s": statistics.median(r[0] for r in reps),
        "median_async_blocked_s": statistics.median(r[1] for r in reps),
        "median_async_background_s": statistics.median(r[2] for r in reps),
        "state_bytes": state_bytes(state), "checkpoint_bytes": sizes,
        "files": {name: sorted(files(folder / name)) for name in ("sync_0", "during")},
        "tensors": len(at_call), "loaded_equal": loads,
        "during": {"returned_s": returned_s, "written_s": written[0], "update_s": update_s,
                   "snapshot_s": snapshot_s, "steps_s": steps_s,
                   "steps_begun_before_written": sum(b < written[0] for b, _ in steps_s),
                   "equal_to_state_at_call": every_rank(equal_count(at_call, loaded), ctx, group),
                   "equal_to_state_after_update": every_rank(equal_count(after_update, loaded),
                                                             ctx, group),
                   "equal_to_state_after_steps": every_rank(equal_count(later, loaded), ctx,
                                                            group),
                   "unchanged_by_steps": every_rank(equal_count(at_call, later), ctx, group)},
    }


def crash(args, ctx, group, root, log):
    """Part "crash": checkpoint 1 complete, then SIGKILL on rank 0 during checkpoint 2."""
    folder = root / "crash"
    fresh_folder(folder, ctx, group)
    trainer = Trainer(args, ctx, args.seed)
    for _ in range(args.steps):
        trainer.step()
    state = trainer.state()
    dcp.async_save(state, checkpoint_id=folder / "step_1", process_group=group).result()
    dist.barrier(group=group)  # every rank's part is written, and rank 0 wrote .metadata
    if ctx.is_main:
        record = {"step": args.steps, "sha256": state_digest(state)}
        (folder / "step_1.json").write_text(json.dumps(record) + "\n")
        log.info("checkpoint 1 complete: %s", ", ".join(files(folder / "step_1")))
    for _ in range(args.steps):
        trainer.step()
    future = dcp.async_save(trainer.state(), checkpoint_id=folder / "step_2", process_group=group)
    if ctx.is_main:
        log.info("checkpoint 2 staged; rank 0 kills itself before the write completes")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        future.result()
    except (Exception, dcp.CheckpointException) as exc:  # not an Exception: a BaseException
        log.warning("checkpoint 2 failed here too: %s", described(exc))
    # A rank whose peer died is stopped by torchrun's agent (within its 0.1 s monitor
    # interval). Raising here instead would make this rank look like the first to fail.
    time.sleep(STOPPED_WITHIN_S)
    raise RuntimeError(f"torchrun did not stop rank {ctx.rank} after rank 0 died")


def load(args, ctx, group, root):
    """Part "load": each crash checkpoint into a fresh model and optimizer."""
    folder = root / "crash"
    out = {}
    for name in ("step_1", "step_2"):
        path = folder / name
        trainer = Trainer(args, ctx, args.seed + 1)
        fresh_sha = state_digest(trainer.state())
        record = folder / f"{name}.json"
        # A rank makes the folder as it plans its part: one killed sooner leaves none.
        r = {"folder_exists": path.is_dir(), "files": sorted(files(path)) if path.is_dir() else [],
             "sha256_beside": record.exists()}
        try:
            trainer.load(path, group)
        except (Exception, dcp.CheckpointException) as exc:  # what a resume would meet
            causes = getattr(exc, "failures", {})  # a CheckpointException's, per rank
            r.update(loaded=False, error=described(exc),
                     causes={rank: described(e) for rank, (e, _) in causes.items()},
                     mentions_metadata="metadata" in str(exc))
        else:
            r["loaded"] = True
            if record.exists():
                saved = json.loads(record.read_text())["sha256"]
                now = state_digest(trainer.state())
                r.update(sha256_equal=every_rank(now == saved, ctx, group),
                         sha256_equal_before=every_rank(fresh_sha == saved, ctx, group))
        dist.barrier(group=group)
        out[name] = r
    return out


class WithoutTraceback(logging.Formatter):
    def formatException(self, ei):
        return ""  # the results report the exception; a traceback would repeat it


def main():
    args = parse_args()
    root = pathlib.Path(args.folder)
    with distributed(group_of_one=True) as ctx:
        log = get_logger(ctx)
        # dcp.load warns on the root logger, with a traceback, as it looks for each metadata
        # file; one line each keeps its words and drops the traceback's paths.
        torch_log = logging.StreamHandler(sys.stdout)
        torch_log.setFormatter(WithoutTraceback(f"[rank {ctx.rank}/{ctx.world_size}] "
                                                "torch: %(message)s"))
        logging.getLogger().addHandler(torch_log)
        group = dist.new_group(backend="gloo")
        results = {"world_size": ctx.world_size, "device": str(ctx.device), "part": args.part}
        if args.part == "time":
            t = results["time"] = time_saves(args, ctx, group, root)
            log.info("state %.1f MB; checkpoint %.1f MB on disk", t["state_bytes"] / 1e6,
                     t["checkpoint_bytes"]["sync_0"] / 1e6)
            log.info("median blocked: dcp.save %.3f s, dcp.async_save %.3f s (+ %.3f s in the "
                     "background)", t["median_sync_s"], t["median_async_blocked_s"],
                     t["median_async_background_s"])
            d = t["during"]
            log.info("written %.3f s after the call; update %.3f-%.3f s, steps %s s",
                     d["written_s"], *d["update_s"],
                     ", ".join(f"{b:.3f}-{e:.3f}" for b, e in d["steps_s"]))
            log.info("of its %d tensors, the checkpoint equals the state at the call in %s, "
                     "after the steps in %s (per rank)", t["tensors"],
                     d["equal_to_state_at_call"], d["equal_to_state_after_steps"])
        elif args.part == "crash":
            crash(args, ctx, group, root, log)
        else:
            r = results["load"] = load(args, ctx, group, root)
            for name, x in r.items():
                log.info("%s: %s", name, "loaded" if x["loaded"] else x["error"])
                for rank, cause in x.get("causes", {}).items():
                    log.info("  rank %s: %s", rank, cause)
        write_results(ctx, args.results, results, args=vars(args))


if __name__ == "__main__":
    main()
