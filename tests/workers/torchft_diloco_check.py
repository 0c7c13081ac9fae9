"""Worker: the course's DiLoCo from scratch (ddp_course.local_sgd) against torchft's own
(torchft.local_sgd.DiLoCo, torchft 0.2.0), in float64, on the same batches.

Every rank builds the same MLP (same seed) and trains on its own batches: AdamW inside,
Nesterov SGD (lr 0.7, momentum 0.9) outside, a synchronisation every 3 inner steps, 6
steps. The course's DiLoCo averages over the torchrun process group; torchft's runs with
every rank as a replica group of one process: rank 0 starts a Lighthouse, each rank a
``torchft.Manager`` (its own TCPStore, a reconfigurable gloo process group,
``min_replica_size=2``) that forms a quorum at every synchronisation.

Conventions that make the two comparable (torchft 0.2.0, ``torchft/local_sgd.py``):

* ``use_async_quorum=False`` (torchft's DiLoCo refuses anything else): the quorum is
  formed synchronously by ``manager.start_quorum()``, which DiLoCo calls itself in the
  inner optimizer's step post-hook before each synchronisation; the training loop calls
  nothing of the manager.
* ``init_sync=False``: the replicas start from the same seed. With the default
  ``init_sync=True`` a replica that is not the quorum's first loads the first one's
  state (model, inner optimizer, DiLoCo's backup and outer optimizer) at the first
  quorum, which DiLoCo forms only at the first synchronisation: its own 3 inner steps
  would then be replaced by the other replica's.
* torchft keeps the parameters of the last synchronisation in a backup copy (CPU) taken
  when DiLoCo is built, not when the block is entered; both are the initial parameters
  here. Pseudo-gradient: backup minus current, as in the course. It all-reduces one
  tensor per parameter (the course: one flat tensor), sums and divides by the number of
  participants (the course: by the group's size): the same float64 numbers for 2 ranks.
  It then restores the backup, sets ``.grad`` to the averaged pseudo-gradient, steps the
  outer optimizer, copies the result to the backup and ``lerp``s the parameters towards
  the pre-sync local ones by ``fragment_update_alpha`` (0 by default: unchanged), and
  ``zero_grad``s the outer optimizer (grads to None, as the course does). The inner
  optimizer's state (AdamW's moments) is never averaged, in either.
* torchft steps the outer optimizer only when ``manager.should_commit()`` agrees (every
  replica healthy, at least ``min_replica_size``); the manager's step counts the commits.
* torchft's ``Manager`` binds its ManagerServer on ``[::]`` (every interface; no setting
  in 0.2.0) and, by default, serves checkpoints over HTTP on every interface too.
  ``ddp_course.torchft_loopback.manager`` binds it to 127.0.0.1 and sends checkpoints
  with ``PGTransport`` (over the replicas' gloo group, no listener); the Lighthouse takes
  a bind address; gloo follows ``GLOO_SOCKET_IFNAME`` (loopback, set by the course's
  launcher).

Reports, from rank 0: per synchronisation, the largest difference between torchft's
parameters and the course's (every rank), and between ranks for each; the same between
synchronisations; the manager's committed steps; this job's listening sockets while
torchft runs and after everything shut down.

    torchrun --nproc_per_node=2 tests/workers/torchft_diloco_check.py --results r.json
"""

# ruff: noqa: E402  (torchft reads RUST_LOG when it is imported)
import os

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust servers: warnings, not info

import datetime
import gc

import psutil
import torch
import torch.distributed as dist
import worker_checks  # tests/workers/, the script's folder
from torch.nn.utils import parameters_to_vector
from torchft import ProcessGroupGloo
from torchft.coordination import LighthouseServer
from torchft.local_sgd import DiLoCo as TorchftDiLoCo

from ddp_course import torchft_loopback
from ddp_course.harness import loopback
from ddp_course.local_sgd import DiLoCo
from ddp_course.models import MLP
from ddp_course.runtime import distributed
from ddp_course.tools.debug import rank_spread
from ddp_course.tools.records import write_results

args = worker_checks.parse_args(steps=6, sync_every=3, batch_size=4, lr=0.05)
TIMEOUT = datetime.timedelta(seconds=30)
LOOPBACK = torchft_loopback.LOOPBACK


def model():
    torch.manual_seed(0)
    return MLP(8, 16, 2, 4).double()


def optimizers(m):
    inner = torch.optim.AdamW(m.parameters(), lr=args.lr)
    outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return inner, outer


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(args.batch_size, 8, dtype=torch.float64, generator=g), torch.randint(
        0, 4, (args.batch_size,), generator=g
    )


def flat(m):
    return parameters_to_vector(m.parameters()).detach()


def train(m, inner, rank):
    """The inner loop (the DiLoCo block is open around it); the parameters after every
    step."""
    seen = []
    for step in range(args.steps):
        x, y = batch(step, rank)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        inner.step()  # every sync_every-th also synchronises
        inner.zero_grad()
        seen.append(flat(m))
    return seen


def course_run(rank):
    m = model()
    inner, outer = optimizers(m)
    with DiLoCo(m, inner, outer, args.sync_every) as d:
        seen = train(m, inner, rank)
    return seen, d.syncs


def listeners():
    """(address, port) of every TCP socket this process listens on."""
    return sorted(
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    )


def torchft_run(rank, lighthouse_addr):
    store = loopback.serve_on_loopback(LOOPBACK, 0)  # this replica group's own store
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    m = model()
    inner, outer = optimizers(m)

    def state_dict():
        return {"model": m.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        m.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = torchft_loopback.manager(
        pg,
        state_dict,
        load_state_dict,
        replica_id=f"replica_{rank}",
        lighthouse_addr=lighthouse_addr,
        store_port=store.port,
        min_replica_size=2,
        timeout=TIMEOUT,
        use_async_quorum=False,
        init_sync=False,
    )
    try:
        diloco = TorchftDiLoCo(
            manager, [m], inner, outer, sync_every=args.sync_every, pin_memory=False
        )
        with diloco:
            seen = train(m, inner, rank)
        during = listeners()
        info = {
            "committed_steps": manager.current_step(),
            "participants": manager.num_participants(),
            "listeners_during": during,
        }
    finally:
        manager.shutdown()
        pg.shutdown()
    del store, pg, manager
    gc.collect()
    return seen, info


def spread(tensors):
    """Largest difference between any rank's tensor and rank 0's, per tensor of the
    list (every rank passes its own list)."""
    return [rank_spread(t) for t in tensors]


with distributed(device="cpu") as ctx:  # a gloo comparison in float64, whatever the GPUs
    before = listeners()
    lighthouse = None
    addr = [None]
    if ctx.rank == 0:
        lighthouse = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=ctx.world_size)
        port = lighthouse.address().rsplit(":", 1)[1]  # it names the host name
        addr = [f"http://{LOOPBACK}:{port}"]
    dist.broadcast_object_list(addr, src=0)
    lighthouse_listening = listeners() if ctx.rank == 0 else []

    course, course_syncs = course_run(ctx.rank)
    ft, info = torchft_run(ctx.rank, addr[0])

    dist.barrier()  # every manager is down before the lighthouse goes
    if lighthouse is not None:
        lighthouse.shutdown()
        del lighthouse
        gc.collect()
    after = listeners()

    sync_steps = [s for s in range(args.steps) if (s + 1) % args.sync_every == 0]
    between_steps = [s for s in range(args.steps) if s not in sync_steps]
    gaps = [(a - b).abs().max().item() for a, b in zip(ft, course)]
    init = flat(model())
    moved = min((c - init).abs().max().item() for c in course)
    every = [None] * ctx.world_size
    dist.all_gather_object(
        every,
        {
            "gaps": gaps,
            "committed_steps": info["committed_steps"],
            "participants": info["participants"],
            "listeners_during": info["listeners_during"],
            "listeners_before": before,
            "listeners_after": after,
            "moved": moved,
        },
    )
    course_spread, ft_spread = spread(course), spread(ft)
    out = {
        "world_size": ctx.world_size,
        "sync_steps": sync_steps,
        "course_syncs": course_syncs,
        # per synchronisation, the largest over the ranks
        "ft_vs_course_after_sync": [max(r["gaps"][s] for r in every) for s in sync_steps],
        "ft_vs_course_between": [max(r["gaps"][s] for r in every) for s in between_steps],
        "ranks_course_after_sync": [course_spread[s] for s in sync_steps],
        "ranks_torchft_after_sync": [ft_spread[s] for s in sync_steps],
        "ranks_course_between": [course_spread[s] for s in between_steps],
        "ranks_torchft_between": [ft_spread[s] for s in between_steps],
        "moved_from_init": min(r["moved"] for r in every),
        "committed_steps": [r["committed_steps"] for r in every],
        "participants": [r["participants"] for r in every],
        "lighthouse_listening": lighthouse_listening,
        "listeners": {
            str(rank): {
                k: r[k] for k in ("listeners_before", "listeners_during", "listeners_after")
            }
            for rank, r in enumerate(every)
        },
    }
    write_results(ctx, args.results, out)
