"""Replica groups that train through a failure (torchft), against a job that restarts whole.

Run from the repository root. Replica groups: a Lighthouse first, then one torchrun
per group (each group is one process here; --die-at-step makes group 1 kill itself):
    RUST_LOG=warn torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 \\
        --heartbeat_timeout_ms 1000
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    torchrun --nproc_per_node=1 --max-restarts=1 scripts/17_replicas.py --replica-id 0
    torchrun --nproc_per_node=1 --max-restarts=1 scripts/17_replicas.py --replica-id 1 \\
        --die-at-step 30
One job that restarts whole from a snapshot (lesson 11's way):
    torchrun --nproc_per_node=2 --max-restarts=1 scripts/17_replicas.py --mode ddp \\
        --snapshot build/17_ft/snapshot.pt --die-at-step 30

Mode "replica": this process is a replica group of one rank with a torchft Manager
(ddp_course.torchft_loopback: every listener on loopback). Every step it asks the
Lighthouse for a quorum (``start_quorum``: a group that is behind receives a live
group's model, optimizer and schedule there, over the groups' gloo process group),
computes the gradient of its own batch (drawn from its replica id and the step),
averages it across the quorum (``manager.allreduce``, one flat tensor) and steps
AdamW only if every group agrees the step succeeded (``should_commit``). With
--die-at-step K, the first attempt (TORCHELASTIC_RESTART_COUNT 0) sends itself
SIGKILL at step K after its backward pass, before its all-reduce: the other groups
are inside theirs. torchrun (--max-restarts) starts it again; it builds its model from
another seed, so only healing can give it the others' parameters.

Mode "ddp": the same model and batches as one DDP job of --nproc-per-node ranks (rank
r draws replica r's batches), with a snapshot (model, optimizer, schedule, step) written
atomically every --snapshot-every steps; with --die-at-step K the last rank sends itself
SIGKILL before step K on the first attempt, torchrun restarts every rank and they
resume from the snapshot.

--timeline FILE gets one JSON line per step (and one when a process starts or kills
itself), appended and flushed at once, so the lines of a killed attempt survive it.
--lab changes the replica mode: "stale-schedule" leaves the learning-rate schedule out
of the state a joining group receives; "stops-on-error" raises when a step cannot be
committed (a peer died), as a plain DDP job's rank does when a collective fails.
--results gets the final state's SHA-256 (model, optimizer and schedule) and the
step count.
"""

import datetime
import math
import os
import signal
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ddp_course.checkpoint import load_checkpoint, save_checkpoint
from ddp_course.data import lm_batch, shakespeare_bytes
from ddp_course.harness.script_args import script_parser
from ddp_course.models import TinyGPT, lm_loss
from ddp_course.runtime import distributed
from ddp_course.tools.debug import state_digest
from ddp_course.tools.records import write_results
from ddp_course.tools.timeline import Timeline

TIMEOUT = datetime.timedelta(seconds=30)  # every torchft collective, quorum and connection


def parse_args():
    meaning = {"batch_size": "sequences per replica group (or rank) per step",
               "steps": "committed steps to train", "lr": "AdamW's peak learning rate"}
    p = script_parser(__doc__, d_model=64, n_heads=4, n_layers=2, seq_len=64, batch_size=8,
                      steps=120, lr=3e-3, seed=0, results=None, help=meaning)
    p.add_argument("--mode", choices=("replica", "ddp"), default="replica")
    p.add_argument("--replica-id", type=int, default=0, help="this replica group's number")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="the Lighthouse's address (default: $TORCHFT_LIGHTHOUSE)")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="the fewest replica groups a step may be committed with")
    p.add_argument("--die-at-step", type=int, default=None,
                   help="kill this process (replica) or the last rank (ddp) at this step, "
                        "first attempt only")
    p.add_argument("--replicas", type=int, default=2,
                   help="replica groups that start together: the first step waits for them")
    p.add_argument("--rejoin-after", type=float, default=0.0,
                   help="seconds a restarted replica group waits before it joins (a "
                        "replacement machine's start-up)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warmup")
    p.add_argument("--snapshot", default=None, help="ddp mode: the snapshot's file")
    p.add_argument("--snapshot-every", type=int, default=25,
                   help="ddp mode: steps between snapshots")
    p.add_argument("--timeline", default=None, help="append one JSON line per step here")
    p.add_argument("--lab", choices=("none", "stale-schedule", "stops-on-error"), default="none")
    args = p.parse_args()
    if args.mode == "replica" and not args.lighthouse:
        p.error("replica mode needs the Lighthouse's address: --lighthouse or $TORCHFT_LIGHTHOUSE")
    if args.mode == "ddp" and args.snapshot is None:
        p.error("ddp mode needs --snapshot FILE")
    return args


def schedule(args):
    """Learning-rate factor of step s: linear warmup, then a cosine down to 0.1."""

    def factor(s):
        warm = min(1.0, (s + 1) / args.warmup)
        return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    return factor


def build(args, seed, device):
    torch.manual_seed(seed)
    model = TinyGPT(d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
                    seq_len=args.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args))
    return model, opt, sched


def batch(args, tokens, replica, step, device):
    """Replica ``replica``'s batch of step ``step``: the same whenever the step is redone."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + 1000 * step + replica)
    return tuple(t.to(device) for t in lm_batch(tokens, args.batch_size, args.seq_len, g))


def die(timeline, step):
    timeline.add(event="sigkill", step=step)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no exception: a crashed host


def replica_train(args, ctx, timeline, attempt):
    from torchft import ProcessGroupGloo

    from ddp_course import torchft_loopback

    # A restarted group starts from other weights: only healing can make them the others'.
    model, opt, sched = build(args, args.seed + 1000 * attempt, ctx.device)
    if attempt > 0:
        time.sleep(args.rejoin_after)
    params = list(model.parameters())

    def state_dict():
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if args.lab != "stale-schedule":
            state["schedule"] = sched.state_dict()
        return state

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if "schedule" in state:
            sched.load_state_dict(state["schedule"])

    pg = ProcessGroupGloo(timeout=TIMEOUT)
    manager = torchft_loopback.manager(
        pg, state_dict, load_state_dict, replica_id=f"replica_{args.replica_id}",
        lighthouse_addr=args.lighthouse, store_port=int(os.environ["MASTER_PORT"]),
        min_replica_size=args.min_replicas, timeout=TIMEOUT,
        use_async_quorum=False,  # heal before the forward pass, on the main thread
        init_sync=False,  # every group starts from the same seed
    )
    tokens = shakespeare_bytes("train")
    digest = state_digest(state_dict())  # after each step: the next step's state before it
    try:
        while manager.current_step() < args.steps:
            t0, before, step_before = time.time(), digest, manager.current_step()
            manager.start_quorum()
            t_quorum = time.time()
            step = manager.current_step()
            if attempt == 0 and step == 0 and manager.num_participants() < args.replicas:
                continue  # the first step waits for every replica group to join
            if step != step_before:  # behind the quorum: a peer's state may have come
                digest = state_digest(state_dict())
            healed = digest != before  # a peer's state was loaded
            x, y = batch(args, tokens, args.replica_id, step, ctx.device)
            loss = lm_loss(model(x), y)
            loss.backward()
            if step == args.die_at_step and attempt == 0:
                die(timeline, step)
            t_backward = time.time()
            flat = parameters_to_vector([p.grad for p in params])
            manager.allreduce(flat).wait()  # the average over the quorum's groups
            vector_to_parameters(flat, [p.grad for p in params])
            t_allreduce = time.time()
            commit = manager.should_commit()
            if not commit and args.lab == "stops-on-error":
                raise RuntimeError(f"step {step}: a collective failed")  # as DDP would
            if commit:
                opt.step()
                sched.step()
            opt.zero_grad()
            digest = state_digest(state_dict())
            timeline.add(event="step", step=step, committed=commit, healed=healed,
                         participants=manager.num_participants(), loss=loss.item(),
                         quorum_s=t_quorum - t0, compute_s=t_backward - t_quorum,
                         allreduce_s=t_allreduce - t_backward, step_s=time.time() - t0,
                         lr=opt.param_groups[0]["lr"], digest=digest[:16],
                         tokens=x.numel())
        final = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "schedule": sched.state_dict()}
        return {"steps": manager.current_step(), "digest": state_digest(final),
                "parameters_digest": state_digest(final["model"]),
                "batches_committed": manager.batches_committed()}
    finally:
        manager.shutdown()
        pg.shutdown()


def ddp_train(args, ctx, timeline, attempt):
    model, opt, sched = build(args, args.seed, ctx.device)
    ddp = DDP(model) if ctx.world_size > 1 else model
    tokens = shakespeare_bytes("train")
    start = 0
    if os.path.exists(args.snapshot):
        extra = load_checkpoint(args.snapshot, model, opt)
        sched.load_state_dict(extra["schedule"])
        start = extra["step"]
        timeline.add(event="resumed", step=start)
    for step in range(start, args.steps):
        t0 = time.time()
        if step == args.die_at_step and attempt == 0 and ctx.rank == ctx.world_size - 1:
            die(timeline, step)
        x, y = batch(args, tokens, ctx.rank, step, ctx.device)
        loss = lm_loss(ddp(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if (step + 1) % args.snapshot_every == 0:
            save_checkpoint(ctx, args.snapshot, model, opt, step=step + 1,
                            schedule=sched.state_dict())
        if ctx.is_main:
            timeline.add(event="step", step=step, committed=True, participants=ctx.world_size,
                         loss=loss.item(), step_s=time.time() - t0,
                         tokens=x.numel() * ctx.world_size)
    final = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "schedule": sched.state_dict()}
    return {"steps": args.steps, "digest": state_digest(final),
            "parameters_digest": state_digest(final["model"]), "resumed_from": start}


def main():
    args = parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with distributed(device="cpu") as ctx:  # gloo: replica groups share this machine's CPU
        who = args.replica_id if args.mode == "replica" else ctx.rank
        timeline = Timeline(args.timeline, mode=args.mode, replica=who, attempt=attempt)
        if args.mode == "replica" or ctx.is_main:
            timeline.add(event="start")
        train = replica_train if args.mode == "replica" else ddp_train
        out = train(args, ctx, timeline, attempt)
        out.update(mode=args.mode, replica=who, attempt=attempt, lab=args.lab)
        write_results(ctx, args.results, out, args=vars(args))


if __name__ == "__main__":
    main()
