"""All-reduce built by hand from point-to-point operations, with bytes counted.

Two designs for summing a tensor over N ranks (notebook 04):

- **parameter server**: every worker sends its whole tensor (K bytes) to
  one server rank, which reduces and sends the result back. The server
  receives (N-1)K and sends (N-1)K bytes, 2(N-1)K in all, and that grows
  with N; each worker sends K and receives K.
- **ring all-reduce**: the tensor is cut into N chunks; a reduce-scatter
  (N-1 steps, each rank passes one chunk to its right neighbour and adds
  the chunk from its left one) leaves each rank with one fully reduced
  chunk, and an all-gather (N-1 more steps) circulates the reduced chunks.
  Every rank sends and receives 2(N-1)/N * K bytes, which stays below 2K
  however large N grows: the ring is bandwidth-optimal
  (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
  clusters of workstations", JPDC 2009; Gibiansky, "Bringing HPC
  techniques to deep learning", Baidu Research 2017).

Everything here uses only ``isend``/``irecv`` (on NCCL inside one
``dist.batch_isend_irecv`` call, so that a send and a receive between the
same two ranks do not wait for each other), so it runs on gloo (CPU
tensors) and nccl (CUDA tensors). Without a process group (a plain
``python script.py``) the world size is 1 and the functions return at once:
:func:`group_rank_and_size`, the check every mechanism of the package makes
before its collectives.

The bytes each rank should move are in ``ddp_course.comm_cost``; the
simulation of asynchronous parameter-server SGD is in ``ddp_course.parameter_server``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_cost import CommStats
from .partition import check_rank, partition
from .runtime import require_group

__all__ = [
    "OPS",
    "SEGMENT_BYTES",
    "group_rank_and_size",
    "parameter_server_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_schedule",
]

OPS = ("sum", "avg", "max", "min")
"""Reduction operations the hand-written collectives accept."""


def ring_schedule(world_size: int, phase: str) -> list[list[tuple[int, int]]]:
    """Which chunk each rank sends and receives at each step of a ring phase.

    Rank r always sends to rank r+1 and receives from rank r-1 (mod N).

    - ``"reduce_scatter"``: at step s, rank r sends chunk (r-s-1) mod N and
      receives chunk (r-s-2) mod N, which it adds to its own copy; what it
      sends at step s+1 is what it just received, so a chunk collects one
      more rank's contribution per step, and after N-1 steps rank r holds
      chunk r reduced over all ranks.
    - ``"all_gather"``: at step s, rank r sends chunk (r-s) mod N and
      receives chunk (r-s-1) mod N, which replaces its copy.

    Args:
        world_size: N >= 1.
        phase: ``"reduce_scatter"`` or ``"all_gather"``.

    Returns:
        ``schedule[step][rank] == (chunk sent, chunk received)``; N-1 steps.

    Raises:
        ValueError: unknown phase or ``world_size < 1``.
    """
    if phase not in ("reduce_scatter", "all_gather"):
        raise ValueError(f"phase must be 'reduce_scatter' or 'all_gather', not {phase!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    shift = 1 if phase == "reduce_scatter" else 0
    n = world_size
    return [
        [((r - s - shift) % n, (r - s - shift - 1) % n) for r in range(n)] for s in range(n - 1)
    ]


def _check_tensor(tensor: torch.Tensor, op: str | None = None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (call .contiguous() and copy back)")
    if op is not None:
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, not {op!r}")
        if tensor.is_complex() or tensor.dtype == torch.bool:
            raise ValueError(f"cannot reduce dtype {tensor.dtype}; use a float or integer tensor")
    return tensor.view(-1)


def group_rank_and_size(
    group=None,
    needed_for: str | None = None,
    expected: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size: the check before a collective.

    Without a process group (a plain ``python script.py``) one process is a
    world of one, ``(0, 1)``, unless ``needed_for`` says what cannot run
    without one. Every mechanism of the package asks here (or, for the group
    object itself, :func:`ddp_course.runtime.require_group`, whose message this
    raises), so a job started the wrong way stops with what to do instead of
    torch's "Default process group has not been initialized".

    Args:
        group: a process group, or None for the default (world) group.
        needed_for: what needs a process group (e.g. ``"sequence parallelism"``);
            None: run alone as ``(0, 1)``.
        expected: the ``(rank, world_size)`` a caller was given (a layer built for
            one rank of N); checked against ``group`` when a process group exists,
            so one process may still build any rank's layer to test it.

    Returns:
        ``(rank, world_size)`` in ``group``.

    Raises:
        RuntimeError: no process group while ``needed_for`` is given: call
            ``torch.distributed.init_process_group()`` or run under torchrun.
        ValueError: this process is not a member of ``group`` (call it on the
            group's ranks only), or ``expected`` differs from the group (pass
            ``ctx.rank`` and ``ctx.world_size``).
    """
    if needed_for is not None:
        require_group(group, needed_for)
    if not dist.is_initialized():
        return 0, 1
    actual = dist.get_rank(group), dist.get_world_size(group)
    if actual[0] < 0:
        raise ValueError(
            "this process is not a member of the group it was given: call this on the "
            "group's ranks only"
        )
    if expected is not None and tuple(expected) != actual:
        raise ValueError(
            f"rank={expected[0]}, world_size={expected[1]} do not match the process group "
            f"(rank {actual[0]} of {actual[1]}): pass ctx.rank and ctx.world_size"
        )
    return actual


def _combine(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    if op in ("sum", "avg"):
        acc.add_(incoming)
    elif op == "max":
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


def _finish_avg(t: torch.Tensor, world_size: int) -> None:
    if t.is_floating_point():
        t.div_(world_size)
    else:
        # Integers: truncate toward zero, as C integer division (NCCL's
        # ncclAvg on integer types); gloo's all_reduce refuses AVG on them.
        t.copy_(torch.div(t, world_size, rounding_mode="trunc"))


def _scratch(like: torch.Tensor, numel: int, scratch: torch.Tensor | None) -> torch.Tensor:
    if scratch is None:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    if scratch.dtype != like.dtype or scratch.device != like.device:
        raise ValueError(
            f"scratch is {scratch.dtype} on {scratch.device}, need {like.dtype} on {like.device}"
        )
    if not scratch.is_contiguous() or scratch.numel() < numel:
        raise ValueError(f"scratch must be contiguous with >= {numel} elements")
    return scratch.view(-1)[:numel]


class _Exchanger:
    """Posts sends and receives together, waits, combines, counts bytes.

    Every receive and send is posted before any is waited on, which is what
    keeps a ring from deadlocking: no rank blocks in a send before it has
    offered to receive. Messages are cut into segments of at most
    ``segment_bytes``. With gloo each received segment is combined while
    later ones are still in flight, which pays where a core is free to
    overlap them. (With gloo on 2 shared CPU cores, whole messages and 1 to
    16 MiB segments measured the same within the noise.) With nccl every
    segment of a step is posted in one ``batch_isend_irecv`` and all are
    waited for before any is combined: nothing overlaps there.
    """

    def __init__(self, group, segment_bytes: int):
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, not {segment_bytes}")
        self.group = group
        self.segment_bytes = segment_bytes
        self.stats = CommStats()
        # NCCL needs a send and a receive between the same two ranks posted
        # in one group call (batch_isend_irecv), or each waits for the
        # other; gloo takes them one by one, with less Python per message.
        self.batched = dist.is_initialized() and dist.get_backend(group) == "nccl"

    def _peer(self, group_rank: int) -> int:
        # isend/irecv take global ranks; a subgroup numbers its members 0..n-1.
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _split(self, t: torch.Tensor) -> list[torch.Tensor]:
        step = max(1, self.segment_bytes // t.element_size())
        if t.numel() <= step:
            return [t] if t.numel() > 0 else []
        return list(t.split(step))

    def run(self, sends=(), recvs=(), into=(), op: str = "sum") -> None:
        """Exchange, then wait for everything.

        Args:
            sends: ``(tensor, group_rank)`` pairs to send.
            recvs: ``(buffer, group_rank)`` pairs to receive into.
            into: for each receive, a tensor to combine the received data
                into with ``op``, or nothing (the data stays in the buffer).
        """
        incoming = []  # (segment, the part of `into` it combines into or None, peer)
        for i, (buf, peer) in enumerate(recvs):
            segs = self._split(buf)
            accs = self._split(into[i]) if i < len(into) else [None] * len(segs)
            incoming += [(seg, acc, self._peer(peer)) for seg, acc in zip(segs, accs, strict=True)]
            self.stats.bytes_received += buf.numel() * buf.element_size()
        outgoing = [(seg, self._peer(peer)) for t, peer in sends for seg in self._split(t)]
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
        self.stats.steps += 1
        if self.batched:
            ops = [dist.P2POp(dist.irecv, seg, peer, self.group) for seg, _, peer in incoming]
            ops += [dist.P2POp(dist.isend, seg, peer, self.group) for seg, peer in outgoing]
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
            for seg, acc, _ in incoming:
                if acc is not None:
                    _combine(acc, seg, op)
            return
        # gloo only (self.batched is True on nccl): receives and sends alternate so that
        # both directions start at once, and each segment is combined as it arrives.
        recv_works, send_works = [], []
        for i in range(max(len(incoming), len(outgoing))):
            if i < len(incoming):
                recv_works.append(dist.irecv(incoming[i][0], incoming[i][2], self.group))
            if i < len(outgoing):
                send_works.append(dist.isend(outgoing[i][0], outgoing[i][1], self.group))
        for work, (seg, acc, _) in zip(recv_works, incoming, strict=True):
            work.wait()
            if acc is not None:
                _combine(acc, seg, op)
        for work in send_works:
            work.wait()


SEGMENT_BYTES = 4 * 2**20
"""Default segment size of the hand-written collectives, in bytes."""


def ring_reduce_scatter(
    tensor: torch.Tensor,
    op: str = "sum",
    group=None,
    scratch: torch.Tensor | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> tuple[torch.Tensor, CommStats]:
    """Ring reduce-scatter: rank r ends with chunk r reduced over all ranks.

    The flat tensor is cut by :func:`ddp_course.partition.partition`. In step s = 0..N-2, rank
    r sends chunk (r-s-1) mod N to rank r+1 and receives chunk (r-s-2) mod N
    from rank r-1, which it combines into its own copy; after N-1 steps its
    chunk r holds the contributions of all N ranks (:func:`ring_schedule`;
    Patarasuk and Yuan 2009).

    Args:
        tensor: any shape, contiguous, float or integer dtype, on the
            process group's device (CPU for gloo, CUDA for nccl), the same
            shape on every rank; used as the work buffer, so its other
            chunks hold partial results afterwards.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``; ``"avg"`` divides
            the reduced chunk by N (integers: truncated toward zero).
        group: process group (default: the world).
        scratch: optional receive buffer, same dtype and device, at least
            ``ceil(numel / N)`` elements. Reuse one across calls: a fresh
            buffer per call is page-faulted in on first touch, which made a
            64 MiB ring all-reduce about 1.4x slower with gloo on 2 CPU cores.
        segment_bytes: messages are sent in segments of at most this many bytes.

    Returns:
        ``(chunk, stats)``: a view of ``tensor.view(-1)[start:stop]`` for
        this rank's chunk, and the bytes moved: ``K - |chunk r|`` sent,
        ``K - |chunk r-1|`` received.

    Raises:
        ValueError: unknown ``op``, unsupported dtype, non-contiguous
            tensor, unsuitable ``scratch``, this rank not in ``group``.
    """
    flat = _check_tensor(tensor, op)
    rank, size = group_rank_and_size(group)
    bounds = partition(flat.numel(), size)
    ex = _Exchanger(group, segment_bytes)
    if size > 1:
        buf = _scratch(flat, bounds[0][1] - bounds[0][0], scratch)
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in ring_schedule(size, "reduce_scatter"):
            s0, s1 = bounds[step[rank][0]]
            r0, r1 = bounds[step[rank][1]]
            ex.run(
                sends=[(flat[s0:s1], right)],
                recvs=[(buf[: r1 - r0], left)],
                into=[flat[r0:r1]],
                op=op,
            )
    start, stop = bounds[rank]
    chunk = flat[start:stop]
    if op == "avg":
        _finish_avg(chunk, size)
    return chunk, ex.stats


def ring_all_gather(
    tensor: torch.Tensor, group=None, segment_bytes: int = SEGMENT_BYTES
) -> CommStats:
    """Ring all-gather in place: every rank ends with every rank's chunk.

    Rank r's own data must already sit in chunk r of ``tensor.view(-1)``
    (:func:`ddp_course.partition.partition`); the other chunks are overwritten. In step
    s = 0..N-2 rank r sends chunk (r-s) mod N to rank r+1 and receives
    chunk (r-s-1) mod N from rank r-1 straight into place.

    Args:
        tensor: any shape, contiguous, any dtype, the same shape on every rank.
        group: process group (default: the world).
        segment_bytes: messages are sent in segments of at most this many bytes.

    Returns:
        The bytes moved: ``K - |chunk r+1|`` sent, ``K - |chunk r|`` received.

    Raises:
        ValueError: non-contiguous tensor, this rank not in ``group``.
    """
    flat = _check_tensor(tensor)
    rank, size = group_rank_and_size(group)
    bounds = partition(flat.numel(), size)
    ex = _Exchanger(group, segment_bytes)
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in ring_schedule(size, "all_gather"):
        s0, s1 = bounds[step[rank][0]]
        r0, r1 = bounds[step[rank][1]]
        ex.run(sends=[(flat[s0:s1], right)], recvs=[(flat[r0:r1], left)])
    return ex.stats


def ring_all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    group=None,
    scratch: torch.Tensor | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> CommStats:
    """Bandwidth-optimal ring all-reduce in place: reduce-scatter, then all-gather.

    Equals ``dist.all_reduce(tensor, op)`` for any world size >= 1 and any
    length (chunks differ by at most one element when N does not divide it).
    Cost: 2(N-1) steps, each rank sends and receives about 2(N-1)/N * K
    bytes (:func:`ddp_course.comm_cost.ring_bytes`); time about 2(N-1) * alpha + 2(N-1)/N * K / B
    (Patarasuk and Yuan, JPDC 2009; Gibiansky, Baidu Research 2017).

    Args:
        tensor: any shape, contiguous, float or integer dtype, on the
            group's device, the same shape on every rank; overwritten with
            the result on every rank.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``; ``"avg"`` on
            integers truncates toward zero.
        group: process group (default: the world).
        scratch: optional reusable receive buffer (see :func:`ring_reduce_scatter`).
        segment_bytes: messages are sent in segments of at most this many bytes.

    Returns:
        :class:`CommStats` of this rank.

    Raises:
        ValueError: unknown ``op``, unsupported dtype, non-contiguous
            tensor, unsuitable ``scratch``, this rank not in ``group``.
    """
    _, stats = ring_reduce_scatter(tensor, op, group, scratch, segment_bytes)
    return stats + ring_all_gather(tensor, group, segment_bytes)


def parameter_server_all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    group=None,
    root: int = 0,
    scratch: torch.Tensor | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> CommStats:
    """All-reduce through one server rank, in place.

    Every worker sends its tensor to ``root``; the server receives from all
    N-1 workers at once (a buffer each), combines each piece as it arrives,
    and sends the result back to every worker. The server's link carries
    (N-1)K bytes each way, so time grows like 2(N-1) * K / B, against the
    ring's 2(N-1)/N * K / B.

    Args:
        tensor: any shape, contiguous, float or integer dtype, on the
            group's device, the same shape on every rank; overwritten with
            the result on every rank.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
        group: process group (default: the world).
        root: group rank of the server.
        scratch: optional reusable receive buffer for the server, at least
            ``(N-1) * numel`` elements, same dtype and device.
        segment_bytes: messages are sent in segments of at most this many bytes.

    Returns:
        :class:`CommStats` of this rank (:func:`ddp_course.comm_cost.parameter_server_bytes`).

    Raises:
        ValueError: unknown ``op``, unsupported dtype, non-contiguous
            tensor, ``root`` outside the group, unsuitable ``scratch``, this
            rank not in ``group``.
    """
    flat = _check_tensor(tensor, op)
    rank, size = group_rank_and_size(group)
    check_rank(root, size, "root")
    ex = _Exchanger(group, segment_bytes)
    if size == 1:
        return ex.stats
    if rank == root:
        workers = [r for r in range(size) if r != root]
        bufs = _scratch(flat, len(workers) * flat.numel(), scratch)
        bufs = bufs.view(len(workers), flat.numel())
        ex.run(recvs=list(zip(bufs, workers, strict=True)), into=[flat] * len(workers), op=op)
        if op == "avg":
            _finish_avg(flat, size)
        ex.run(sends=[(flat, w) for w in workers])
    else:
        ex.run(sends=[(flat, root)])
        ex.run(recvs=[(flat, root)])
    return ex.stats
