"""Byte accounting of the hand-written all-reduce algorithms (notebook 04).

How many bytes each rank sends and receives, and in how many rounds, when
``ddp_course.collectives`` all-reduces a tensor of K bytes over N ranks:

- ring (reduce-scatter then all-gather): every rank sends and receives
  2(N-1)/N * K bytes in 2(N-1) steps, below 2K for any N (Patarasuk and
  Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009; Gibiansky, "Bringing HPC techniques to deep
  learning", Baidu Research 2017);
- parameter server: the server sends and receives (N-1) * K bytes, each
  worker K, in 2 steps.

The algorithms count what they actually pass to ``isend``/``irecv`` into a
:class:`CommStats`; the functions here give what the formulas expect, so a
test can compare the two. Which bytes each rank owns is
:func:`ddp_course.partition.partition`'s ``"split"`` style.

:class:`CollectiveLog` is the same comparison for code that calls
``torch.distributed``'s collectives directly (sequence parallelism, FSDP2):
it logs every call with its bytes and, on a device mesh, the dimension it
ran on (notebook 13).

A cost model fitted to timings describes one link. :func:`sweep_device_plan`
puts every world size of a sweep on the same device and backend, and
:func:`link_label` names the link that was measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from . import runtime
from .partition import check_rank, partition

__all__ = [
    "CollectiveLog",
    "CommStats",
    "link_label",
    "parameter_server_bytes",
    "ring_bytes",
    "sweep_device_plan",
]


@dataclasses.dataclass
class CommStats:
    """What one rank moved in one or more hand-written collectives.

    Attributes:
        bytes_sent: payload bytes this rank sent (``numel * element_size``
            of everything it passed to ``isend``).
        bytes_received: payload bytes this rank received.
        steps: communication rounds this rank waited for; each costs at
            least one latency (alpha) in the alpha-beta model.

    Stats add up: ``total = reduce_scatter_stats + all_gather_stats``.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(
            self.bytes_sent + other.bytes_sent,
            self.bytes_received + other.bytes_received,
            self.steps + other.steps,
        )

    @property
    def bytes_total(self) -> int:
        """Bytes sent plus bytes received."""
        return self.bytes_sent + self.bytes_received


def ring_bytes(numel: int, element_size: int, world_size: int, rank: int) -> CommStats:
    """The traffic :func:`ddp_course.collectives.ring_all_reduce` causes at ``rank``, in bytes.

    In the reduce-scatter rank r sends every chunk but its own (chunk r) and
    receives every chunk but chunk r-1; in the all-gather it sends every
    chunk but chunk r+1 and receives every chunk but its own. So it sends
    ``2K - |chunk r| - |chunk r+1|`` bytes and receives
    ``2K - |chunk r-1| - |chunk r|``. When ``numel`` is a multiple of N both
    are exactly ``2(N-1)/N * K`` (the bandwidth-optimal bound, Patarasuk and
    Yuan 2009); otherwise they differ from it by less than two elements and
    their mean over ranks is still ``2(N-1)/N * K``.

    Args:
        numel: elements of the tensor; ``K = numel * element_size`` bytes.
        element_size: bytes per element (``tensor.element_size()``), >= 1.
        world_size: N >= 1.
        rank: 0 <= rank < N.

    Returns:
        The expected :class:`CommStats`, with 2(N-1) steps.

    Raises:
        ValueError: on an out-of-range rank or a bad size.
    """
    check_rank(rank, world_size)
    _check_size(numel, element_size)
    if world_size == 1:
        return CommStats()
    sizes = [stop - start for start, stop in partition(numel, world_size)]
    sent = 2 * numel - sizes[rank] - sizes[(rank + 1) % world_size]
    received = 2 * numel - sizes[rank - 1] - sizes[rank]
    return CommStats(sent * element_size, received * element_size, 2 * (world_size - 1))


def parameter_server_bytes(
    numel: int, element_size: int, world_size: int, rank: int, root: int = 0
) -> CommStats:
    """Bytes :func:`ddp_course.collectives.parameter_server_all_reduce` moves at ``rank``.

    The server (``root``) receives K bytes from each of the N-1 workers and
    sends K back to each: (N-1)K each way, 2(N-1)K in all. A worker sends K
    and receives K, whatever N is. Both take 2 steps (gather, then send back).

    Args:
        numel: elements of the tensor; ``K = numel * element_size`` bytes.
        element_size: bytes per element, >= 1.
        world_size: N >= 1.
        rank: 0 <= rank < N.
        root: the server's rank, 0 <= root < N.

    Returns:
        The expected :class:`CommStats`.

    Raises:
        ValueError: on an out-of-range rank or root, or a bad size.
    """
    check_rank(rank, world_size)
    check_rank(root, world_size, "root")
    _check_size(numel, element_size)
    if world_size == 1:
        return CommStats()
    nbytes = numel * element_size * (world_size - 1 if rank == root else 1)
    return CommStats(nbytes, nbytes, 2)


def _check_size(numel: int, element_size: int) -> None:
    if numel < 0 or element_size < 1:
        raise ValueError(f"need numel >= 0 and element_size >= 1, not {numel}, {element_size}")


def sweep_device_plan(world_sizes: Sequence[int], gpus: int | None = None) -> runtime.DevicePlan:
    """One device plan for every launch of a sweep over world sizes.

    An alpha-beta line fitted through timings at N = 2, 3, 4 describes one
    link only if every N ran on the same device and backend. Planning each
    launch on its own would put N = 2 on two GPUs with nccl and N = 3, 4 on
    the CPU with gloo on a 2-GPU machine. So the plan is made once, for the
    largest N (:func:`ddp_course.runtime.device_plan`): CUDA and nccl for all
    of the sweep when that N fits the GPUs, else the CPU and gloo for all of
    it. Pass ``{runtime.DEVICE_ENV: plan.device_type}`` as ``env`` to every
    ``launch.torchrun`` of the sweep.

    Args:
        world_sizes: the ranks of each launch, each >= 1, at least one.
        gpus: GPUs on this machine; default :func:`ddp_course.runtime.gpu_count`.

    Returns:
        The :class:`ddp_course.runtime.DevicePlan` of ``max(world_sizes)`` ranks.

    Raises:
        ValueError: no world sizes, a world size < 1, or ``gpus`` < 0.
    """
    sizes = list(world_sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"need at least one world size, each >= 1, not {sizes}")
    return runtime.device_plan(max(sizes), runtime.gpu_count() if gpus is None else gpus)


def link_label(backend: str, device: str) -> str:
    """What carried the bytes of a run on ``backend`` and ``device``, in a few words.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (a results file's ``backend``).
        device: ``"cpu"`` or ``"cuda:<i>"`` (its ``device``).

    Returns:
        e.g. ``"loopback TCP between processes (gloo, CPU)"``.

    Raises:
        ValueError: a backend other than gloo and nccl.
    """
    on_gpu = device.split(":")[0] == "cuda"
    if backend == "nccl":
        return "GPU to GPU over NVLink or PCIe (nccl)"
    if backend == "gloo":
        if on_gpu:
            return "TCP between processes, CUDA tensors staged through host memory (gloo)"
        return "loopback TCP between processes (gloo, CPU)"
    raise ValueError(f"no link label for backend {backend!r}")


# torch.distributed's functions and the name each call is logged under (the *_single
# names are those of older PyTorch releases).
_WATCHED = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "batch_isend_irecv": "p2p",
}


def _all_to_all_sent(whole: torch.Tensor, splits, group) -> int:
    """Bytes of ``whole`` (rows split by ``splits``, or evenly) that leave this rank."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if not splits:
        return whole.numel() * whole.element_size() * (size - 1) // size
    row = whole[0].numel() * whole.element_size() if len(whole) else 0
    return sum(rows for peer, rows in enumerate(splits) if peer != me) * row


class CollectiveLog:
    """Every ``torch.distributed`` collective called inside ``recording()``: its bytes and group.

    ``with log.recording("forward"): ...`` replaces ``all_reduce``,
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``
    and ``batch_isend_irecv`` of ``torch.distributed`` by wrappers that log each
    call, and restores them afterwards (also on error). Each call is logged in
    :attr:`calls` as ``{"phase", "op", "shape", "dtype", "bytes", "sent", "dims"}``:

    - ``op``: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``
      or ``p2p`` (one ``batch_isend_irecv``);
    - ``bytes``: the size of the *whole* tensor (the all-reduce's tensor, the
      all-gather's output, the reduce-scatter's and the all-to-all's input; the
      tensors a ``p2p`` batch sends), so the calls compare directly: a ring
      sends ``2(N-1)/N`` of it per rank for an all-reduce and ``(N-1)/N`` for an
      all-gather or a reduce-scatter;
    - ``sent``: the bytes this rank sends to other ranks, where the call alone
      says it: an all-to-all's rows for the other ranks (from its
      ``input_split_sizes``, or an even split), a ``p2p`` batch's sends;
      ``None`` for the others, whose traffic depends on the backend's algorithm;
    - ``dims``: with a ``mesh``, the mesh dimension(s) whose process group the
      call ran on (``"tp"``, ``"replicate+shard"`` for HSDP; ``"self"`` for a
      group of one, ``"world"`` for the whole job), found by comparing the
      group's ranks with this rank's group along each dimension and each
      combination of dimensions; without a mesh, ``None``.

    It sees what calls those Python functions (the course's autograd functions,
    FSDP2), not DTensor's functional collectives, which
    ``torch.distributed.tensor.debug.CommDebugMode`` counts, nor DDP's bucket
    all-reduces, which run in C++.

    Args:
        mesh: a ``DeviceMesh`` with named dimensions, or ``None``.
    """

    def __init__(self, mesh=None):
        self.calls: list[dict] = []
        self._dims: dict[tuple[int, ...], str] = {}
        if mesh is not None:
            names = mesh.mesh_dim_names
            # The first name wins where dimensions of size 1 make two groups equal.
            for k in range(1, len(names) + 1):
                for combo in itertools.combinations(names, k):
                    sub = mesh[combo] if k > 1 else mesh[combo[0]]
                    ranks = tuple(sorted(sub.mesh.flatten().tolist()))
                    self._dims.setdefault(ranks, "+".join(combo))
        self._mesh = mesh

    def _group_dims(self, group: dist.ProcessGroup | None) -> str | None:
        if self._mesh is None:
            return None
        ranks = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
        if len(ranks) == 1:
            return "self"
        return self._dims.get(ranks, "world" if len(ranks) == dist.get_world_size() else "?")

    def _record(self, phase, op, named) -> dict:
        if op == "p2p":
            sends = [o for o in named["p2p_op_list"] if o.op in (dist.isend, dist.send)]
            nbytes = sum(o.tensor.numel() * o.tensor.element_size() for o in sends)
            first = sends[0].tensor if sends else named["p2p_op_list"][0].tensor
            group = named["p2p_op_list"][0].group
            return {"phase": phase, "op": op, "shape": list(first.shape),
                    "dtype": str(first.dtype), "bytes": nbytes, "sent": nbytes,
                    "dims": self._group_dims(group)}  # fmt: skip
        tensors = [v for v in named.values() if isinstance(v, torch.Tensor)]
        # The whole tensor: the output of an all-gather, the input otherwise.
        whole = tensors[1] if op in ("reduce_scatter", "all_to_all") else tensors[0]
        group = named.get("group")
        sent = None
        if op == "all_to_all":
            sent = _all_to_all_sent(whole, named.get("input_split_sizes"), group)
        return {"phase": phase, "op": op, "shape": list(whole.shape), "dtype": str(whole.dtype),
                "bytes": whole.numel() * whole.element_size(), "sent": sent,
                "dims": self._group_dims(group)}  # fmt: skip

    @contextlib.contextmanager
    def recording(self, phase: str | None = None) -> Iterator[None]:
        """Log the collectives called inside the ``with`` block under ``phase``."""
        originals = {n: getattr(dist, n) for n in _WATCHED if hasattr(dist, n)}

        def wrap(name, original):
            op, signature = _WATCHED[name], inspect.signature(original)

            def logged(*args, **kwargs):
                # By name, in the signature's order: FSDP2 passes its tensors as keywords.
                named = signature.bind(*args, **kwargs).arguments
                self.calls.append(self._record(phase, op, named))
                return original(*args, **kwargs)

            return logged

        for name, original in originals.items():
            setattr(dist, name, wrap(name, original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def summary(self, phase: str | None = None) -> dict[str, list[int]]:
        """``{op: [bytes of each call]}`` for one phase (or every phase)."""
        out: dict[str, list[int]] = {}
        for c in self.calls:
            if phase is None or c["phase"] == phase:
                out.setdefault(c["op"], []).append(c["bytes"])
        return out

    def counts(self, phase: str | None = None) -> dict[str, int]:
        """``{"<op> <dims>": calls}`` for one phase (or all), e.g. ``"all_gather shard"``."""
        out: dict[str, int] = {}
        for c in self.calls:
            if phase is None or c["phase"] == phase:
                key = f"{c['op']} {c['dims']}"
                out[key] = out.get(key, 0) + 1
        return out
