"""One log of every collective a rank runs, whichever code path issued it.

Every collective of PyTorch reaches the dispatcher as an operator: the
``torch.distributed`` functions (``dist.all_reduce`` runs ``c10d::allreduce_``),
the reducer of ``DistributedDataParallel`` (its bucket all-reduces, from C++),
FSDP2 (``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``), DTensor and
the functional collectives (``_c10d_functional::all_reduce`` and friends),
``batch_isend_irecv`` (one ``c10d::send`` or ``c10d::recv_`` per operation), and
the collectives of a ``torch.compile``'d graph, which calls them as operators too
(see :meth:`CollectiveLog.ignore_compile_internals`). A
``torch.utils._python_dispatch.TorchDispatchMode`` sees each of them, as
PyTorch's own ``torch.distributed.tensor.debug.CommDebugMode`` does for DTensor
(https://pytorch.org/docs/stable/distributed.tensor.html, debugging), so one
:class:`CollectiveLog` counts every one of these paths
(``tests/multiprocess/test_collective_log.py`` checks each against another count).

Each call is one record (:attr:`CollectiveLog.calls`), a dict:

- ``phase``: the label given to :meth:`CollectiveLog.recording`;
- ``op``: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
  ``broadcast``, ``reduce``, ``gather``, ``scatter``, ``send``, ``recv`` or
  ``barrier``;
- ``path``: ``"c10d"`` (a ``ProcessGroup`` call: ``torch.distributed``, DDP,
  FSDP2) or ``"functional"`` (DTensor, functional collectives);
- ``shape``, ``dtype``: of the whole tensor (below); ``bytes``: its size. The
  whole tensor is the all-reduce's, broadcast's and reduce's tensor, the
  all-gather's output, the reduce-scatter's and the all-to-all's input, the
  scatter's and the gather's N pieces (on every rank, though only the root
  holds them), the tensor sent or received; a coalesced call sums its tensors. So the calls
  compare directly with the formulas of a ring;
- ``sent``: the bytes this rank sends to other ranks where the call alone says
  it: an all-to-all's rows for the other ranks, a send's tensor, 0 for a
  receive; ``None`` where the traffic depends on the backend's algorithm;
- ``ring_sent``: what a bandwidth-optimal ring sends per rank, the convention of
  NCCL's busbw (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
  ``2(N-1)/N * bytes`` for an all-reduce, ``(N-1)/N * bytes`` for an
  all-gather or a reduce-scatter, ``sent`` for an all-to-all, a send or a
  receive; ``None`` for the others;
- ``group_size``: N, the ranks in the call's process group;
- ``dims``: with a ``mesh``, the mesh dimension(s) the call's group spans
  (``"tp"``, ``"replicate+shard"`` for HSDP, every name for the whole job, or
  ``"world"`` where the mesh spans fewer ranks; ``"self"`` for a group of one,
  ``"?"`` for a group that is none of these);
  without a mesh, ``None``.

A dispatch mode belongs to the thread that entered it. The autograd engine
carries it to its own threads (backward on a GPU), but a communication hook's
future callback runs on the backend's thread (PowerSGD all-reduces its second
matrix there). So while recording, the log also wraps ``torch.distributed``'s
Python functions (:data:`PYTHON_API`): a call from another thread runs under a
mode of its own that logs into the same list. A collective that C++ starts on
another thread (none in this course) would go unseen.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OPS", "PYTHON_API", "CollectiveLog"]

# The dispatcher's collective operators (namespace, name) and the op each is logged as.
OPS = {
    ("c10d", "allreduce_"): "all_reduce",
    ("c10d", "allreduce_coalesced_"): "all_reduce",
    ("c10d", "_allgather_base_"): "all_gather",
    ("c10d", "allgather_"): "all_gather",
    ("c10d", "allgather_into_tensor_coalesced_"): "all_gather",
    ("c10d", "allgather_coalesced_"): "all_gather",
    ("c10d", "_reduce_scatter_base_"): "reduce_scatter",
    ("c10d", "reduce_scatter_"): "reduce_scatter",
    ("c10d", "reduce_scatter_tensor_coalesced_"): "reduce_scatter",
    ("c10d", "alltoall_base_"): "all_to_all",
    ("c10d", "alltoall_"): "all_to_all",
    ("c10d", "broadcast_"): "broadcast",
    ("c10d", "reduce_"): "reduce",
    ("c10d", "gather_"): "gather",
    ("c10d", "scatter_"): "scatter",
    ("c10d", "send"): "send",
    ("c10d", "recv_"): "recv",
    ("c10d", "recv_any_source_"): "recv",
    ("c10d", "barrier"): "barrier",
    ("c10d", "monitored_barrier_"): "barrier",
    ("_c10d_functional", "all_reduce"): "all_reduce",
    ("_c10d_functional", "all_reduce_"): "all_reduce",
    ("_c10d_functional", "all_reduce_coalesced"): "all_reduce",
    ("_c10d_functional", "all_reduce_coalesced_"): "all_reduce",
    ("_c10d_functional", "all_gather_into_tensor"): "all_gather",
    ("_c10d_functional", "all_gather_into_tensor_out"): "all_gather",
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): "all_gather",
    ("_c10d_functional", "reduce_scatter_tensor"): "reduce_scatter",
    ("_c10d_functional", "reduce_scatter_tensor_out"): "reduce_scatter",
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): "reduce_scatter",
    ("_c10d_functional", "all_to_all_single"): "all_to_all",
    ("_c10d_functional", "broadcast"): "broadcast",
    ("_c10d_functional", "broadcast_"): "broadcast",
}

# Which argument holds the whole tensor (see the module docstring), by op.
_WHOLE = {"all_gather": ("output_tensor", "output_tensors", "outputs", "output_lists", "out")}
# Scatter and gather: the argument that holds this rank's own piece (c10d's schema).
_PIECE = {"scatter": "output_tensors", "gather": "input_tensors"}
_INPUT = ("input_tensor", "input_tensors", "inputs", "input_list", "input", "tensors", "tensor")


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of an argument: a tensor, a list of them, or a list of lists."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# torch.distributed's Python functions: a call to one from another thread (a communication
# hook's future callback runs on the backend's thread) is logged too. Not isend and irecv:
# P2POp checks that it was given those very functions.
PYTHON_API = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "batch_isend_irecv",
    "barrier",
)


class _OtherThread(TorchDispatchMode):
    """The log's eyes on another thread, for one call (dispatch modes are per thread)."""

    supports_higher_order_operators = True  # see CollectiveLog.log_and_run

    def __init__(self, log: CollectiveLog):
        super().__init__()
        self.log = log

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # see CollectiveLog.ignore_compile_internals

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.log.log_and_run(func, types, args, kwargs)


class CollectiveLog(TorchDispatchMode):
    """Every collective run inside ``recording()``, from any code path: op, bytes, group.

    ``with log.recording("forward"): ...`` logs each collective operator the
    block dispatches (see the module docstring for what a record holds) and
    changes nothing of what runs. The log is a ``TorchDispatchMode``: inside
    the block, :meth:`__torch_dispatch__` sees every operator first.
    :meth:`summary` and :meth:`counts` sum the records by op.

    Args:
        mesh: a ``DeviceMesh`` with named dimensions, or ``None``. With a mesh,
            each record names the dimension(s) its process group spans.

    Raises:
        RuntimeError: from :meth:`recording` when no process group is initialised.
    """

    # A compiled graph can call higher-order operators (a checkpointed region saves its
    # random state with run_and_save_rng_state); without this they would raise.
    supports_higher_order_operators = True

    def __init__(self, mesh=None):
        super().__init__()
        self.calls: list[dict] = []
        self.phase: str | None = None
        self._mesh = mesh
        self._by_ranks: dict[tuple[int, ...], str] = {}  # a group's ranks -> its dimensions
        if mesh is not None:
            names = mesh.mesh_dim_names
            # The first name wins where dimensions of size 1 make two groups equal.
            for k in range(1, len(names) + 1):
                for combo in itertools.combinations(names, k):
                    sub = mesh[combo] if k > 1 else mesh[combo[0]]
                    ranks = tuple(sorted(sub.mesh.flatten().tolist()))
                    self._by_ranks.setdefault(ranks, "+".join(combo))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.log_and_run(func, types, args, kwargs)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: ``torch.compile``'d code inside ``recording()`` stays compiled.

        By default Dynamo will not compile a frame while a dispatch mode is on (it
        skips it: "non-infra torch dispatch mode present"), so the code would run
        eagerly and the log would count eager's collectives, not the compiled
        graph's. With this, Dynamo traces and compiles with the log turned off and
        runs the compiled graph with it on
        (``torch.utils._python_dispatch.TorchDispatchMode.ignore_compile_internals``,
        as PyTorch's own ``DebugMode`` does): what the graph fuses is not seen, but a
        collective is never fused, and the compiled graph calls it through the
        dispatcher, where the log sees it.
        """
        return True

    def log_and_run(self, func, types, args=(), kwargs=None):
        """Log ``func`` if it is a collective (see :data:`OPS`), then run it unchanged."""
        # DTensor first turns its operator into plain ones, its collectives among them,
        # which then come back here (CommDebugMode does the same).
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            # Run as CommDebugMode does, with the mode off: a collective inside a
            # higher-order operator's body would go unseen (none in this course).
            return func(*args, **kwargs)
        op = OPS.get((func.namespace, func._schema.name.split("::")[-1]))
        if op is not None:
            named = {a.name: v for a, v in zip(func._schema.arguments, args)}
            named.update(kwargs)
            path = "c10d" if func.namespace == "c10d" else "functional"
            self.calls.append(self.record(self.phase, op, path, named))
        return func(*args, **kwargs)

    def _dims_of(self, ranks: tuple[int, ...]) -> str | None:
        if self._mesh is None:
            return None
        if len(ranks) == 1:
            return "self"
        return self._by_ranks.get(ranks, "world" if len(ranks) == dist.get_world_size() else "?")

    def _group(self, named: dict) -> tuple[int, int, str | None]:
        """(size, this rank's rank, mesh dimensions) of a call's process group."""
        group = named.get("process_group", named.get("group_name"))
        if isinstance(group, torch.ScriptObject):  # how a c10d operator receives its group
            group = dist.ProcessGroup.unbox(group)
        elif isinstance(group, str):
            # Functional collectives name their group; PyTorch resolves the name so too.
            group = _resolve_process_group(group)
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        return len(ranks), dist.get_rank(group), self._dims_of(ranks)

    def record(self, phase: str | None, op: str, path: str, named: dict) -> dict:
        """The record of one call; ``named``: the operator's arguments by schema name."""
        size, rank, dims = self._group(named)
        if op in _PIECE:
            # Only the root holds the N pieces; every rank holds its own piece.
            whole = _tensors(named[_PIECE[op]]) * size
        else:
            whole = next((_tensors(named[k]) for k in _WHOLE.get(op, ()) if k in named), None)
            if whole is None:
                whole = next(_tensors(named[k]) for k in _INPUT if k in named)
        nbytes = _nbytes(whole)
        if op == "all_gather" and path == "functional" and "out" not in named:
            nbytes *= named["group_size"]  # the output is not an argument
        sent = ring = None
        if op in ("send", "recv"):
            sent = ring = nbytes if op == "send" else 0
        elif op == "all_to_all":
            splits = named.get("input_split_sizes") or [1] * size  # empty: an even split
            row = nbytes // max(sum(splits), 1)
            sent = ring = sum(s for peer, s in enumerate(splits) if peer != rank) * row
        elif op == "all_reduce":
            ring = 2 * (size - 1) * nbytes // size
        elif op in ("all_gather", "reduce_scatter"):
            ring = (size - 1) * nbytes // size
        first = whole[0]
        return {
            "phase": phase,
            "op": op,
            "path": path,
            "shape": list(first.shape),
            "dtype": str(first.dtype),
            "bytes": nbytes,
            "sent": sent,
            "ring_sent": ring,
            "group_size": size,
            "dims": dims,
        }

    @contextlib.contextmanager
    def recording(self, phase: str | None = None) -> Iterator[None]:
        """Log the collectives dispatched inside the ``with`` block under ``phase``."""
        if not dist.is_initialized():
            raise RuntimeError("CollectiveLog needs a process group: init_process_group first")
        self.phase = phase
        here = threading.get_ident()
        originals = {n: getattr(dist, n) for n in PYTHON_API if hasattr(dist, n)}

        def on_any_thread(original):
            @functools.wraps(original)
            def call(*args, **kwargs):
                # Dynamo traces the call into a graph (compiled autograd traces a gradient
                # hook's all-reduce) and cannot trace get_ident: the graph's collective runs
                # under this mode anyway.
                if torch.compiler.is_compiling() or threading.get_ident() == here:
                    return original(*args, **kwargs)
                with _OtherThread(self):
                    return original(*args, **kwargs)

            return call

        for name, original in originals.items():
            setattr(dist, name, on_any_thread(original))
        try:
            with self:
                yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
            self.phase = None

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
