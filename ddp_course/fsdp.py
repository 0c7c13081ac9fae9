"""FSDP from scratch as a module wrapper, the way FSDP2's ``fully_shard`` works (lesson 09).

:class:`ddp_course.sharding.ZeRO` at stage 3 is the optimizer's view of sharding: the
model keeps its full parameters (emptied between uses) and the wrapper owns an optimizer
over separate 1-D shards. :class:`FSDP` is the module's view, the one PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``) takes: every parameter of the wrapped model
*is* this rank's shard, a plain ``nn.Parameter`` of some rows, so an ordinary
``torch.optim.SGD(model.parameters())`` or ``AdamW`` steps only the shard, and the full
weights exist only while a unit runs.

**The sharding rule** is FSDP2's (``_init_sharded_param`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``: ``torch.chunk(param, N, dim=0)``,
missing chunks empty, every chunk padded to chunk 0's size). With ``rows = shape[0]`` and
``t = ceil(rows / N)``, rank ``r`` owns rows ``[min(r t, rows), min((r + 1) t, rows))``
(:func:`ddp_course.partition.partition`, ``"padded"``, on rows): whole rows, the last
ranks fewer or none. On the wire every rank's piece is padded with zero rows to ``t``
rows, so a unit's all-gather output and reduce-scatter input hold
``N * sum_p t_p * row_p`` elements (:func:`unit_numel`; ``row_p`` = elements of a row).

**A unit** is a listed submodule (e.g. each Transformer block) with the parameters
below it that no inner unit claims; the root (the wrapped model) is the unit of what
is left. Per unit and step:

- forward: a pre-hook all-gathers the unit's shards, cast to ``compute_dtype`` first
  (so the bytes on the wire halve for bfloat16), through :class:`GatherUnit`, a custom
  autograd Function whose outputs are the full parameters. They shadow the module's
  attributes (``module.__dict__``) while it runs; ``module.parameters()`` always yields
  the shards;
- after forward, with ``reshard_after_forward`` the full storage is freed
  (``untyped_storage().resize_(0)``: the tensors autograd saved keep their shape and
  lose their memory); a hook on the unit's outputs (``register_multi_grad_hook``,
  "any") all-gathers them again into the same storage when the first gradient of an
  output arrives, before the unit's backward reads them. The root never reshards after
  forward: its backward starts right after its forward (FSDP2's root does the same
  unless ``fully_shard(root, reshard_after_forward=...)`` says otherwise, ``_lazy_init``
  in ``_fsdp_state.py``);
- backward: autograd calls :meth:`GatherUnit.backward` once every full parameter's
  gradient is complete; it casts them to the parameters' dtype, reduce-scatters them
  (summed, then divided by N: the average over ranks) and returns each shard's part,
  which autograd accumulates into ``shard.grad`` (float32 master weights get float32
  gradients whatever the compute dtype); then it frees the full storage.

All-gathers per step: one per unit, plus one more per non-root unit with
``reshard_after_forward``; reduce-scatters: one per unit with trainable parameters
(:meth:`FSDP.step_traffic`). Frozen parameters are sharded and gathered but left out of
the reduce-scatter; a trainable parameter that got no gradient is reduced as zeros (every
rank must join). A parameter tied to several modules must be in one unit (ValueError
otherwise). Buffers stay whole. ``state_dict()`` holds shards: :meth:`FSDP.full_parameters`
gathers the full ones. Gloo runs both collectives on CPU tensors (PyTorch 2.13:
``all_gather_single``, ``reduce_scatter_single``; ``*_into_tensor``/``*_tensor`` before).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .builtin_collectives import all_gather_single, reduce_scatter_single
from .ddp import broadcast_state, check_same_shapes
from .partition import partition
from .runtime import require_group

__all__ = ["FSDP", "GatherUnit", "StepTraffic", "Unit", "unit_numel"]


def unit_numel(shapes: list[torch.Size], world_size: int) -> int:
    """Elements of a unit's all-gather output (or reduce-scatter input): ``N * sum t * row``.

    Args:
        shapes: the full shapes of the unit's parameters (each with dim 0).
        world_size: N >= 1.

    Returns:
        ``N * sum_p ceil(rows_p / N) * row_p``: every rank's piece padded to ``t_p`` rows.
    """
    return world_size * sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes)


@dataclasses.dataclass(frozen=True)
class StepTraffic:
    """Collectives one rank calls in a training step (forward + backward), and their bytes.

    Bytes are those of the whole tensor: an all-gather's output, a reduce-scatter's
    input, padding included (what the course's collective log records).
    """

    all_gathers: int
    all_gather_bytes: int
    reduce_scatters: int
    reduce_scatter_bytes: int


class _Param:
    """One parameter of a unit: where its rows are, and its shard (this rank's rows)."""

    def __init__(self, name: str, param: nn.Parameter, rank: int, world_size: int):
        if param.dim() == 0:
            raise ValueError(f"FSDP shards dim 0, and {name} is a 0-d tensor: make it shape (1,)")
        self.name, self.shape = name, param.shape
        self.rows, self.row = param.shape[0], math.prod(param.shape[1:])
        self.t = math.ceil(self.rows / world_size)  # rows of every rank's (padded) piece
        self.start, self.end = partition(self.rows, world_size, "padded")[rank]
        rows = param.detach()[self.start : self.end].clone()
        self.shard = nn.Parameter(rows, requires_grad=param.requires_grad)
        self.slots: list[tuple[nn.Module, str]] = []  # (module, attribute) that hold it


class Unit:
    """The parameters one pre-forward hook all-gathers together.

    Attributes:
        name: the module's name in the model (``""``: the root).
        module: the listed submodule (or the root).
        params: its parameters, in ``named_parameters`` order.
        piece: elements of one rank's padded piece (``unit_numel / N``).
        is_root: the root unit never reshards after forward.
    """

    def __init__(self, name: str, module: nn.Module, fsdp: FSDP, is_root: bool):
        self.name, self.module, self.fsdp, self.is_root = name, module, fsdp, is_root
        self.params: list[_Param] = []
        self.current: _Gathered | None = None  # between its pre-forward and forward hooks

    def finish(self) -> None:
        """Lay the parameters out once they are all known (offsets in a piece)."""
        dtypes = {p.shard.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"unit {self.name or '(root)'} mixes dtypes {dtypes}")
        n = self.fsdp.world_size
        self.piece = unit_numel([p.shape for p in self.params], n) // n
        self.offsets = list(_offsets([p.t * p.row for p in self.params]))
        trainable = [p for p in self.params if p.shard.requires_grad]
        self.grad_piece = unit_numel([p.shape for p in trainable], n) // n
        self.grad_offsets = list(_offsets([p.t * p.row for p in trainable]))

    # -- the two collectives -------------------------------------------------------

    def all_gather(self, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's padded piece, cast to ``dtype`` before sending: ``[N, piece]``."""
        piece = self.params[0].shard.new_zeros(self.piece, dtype=dtype)
        for p, off in zip(self.params, self.offsets):
            piece[off : off + p.shard.numel()] = p.shard.detach().reshape(-1)
        out = piece.new_empty(self.fsdp.world_size * self.piece)
        all_gather_single(out, piece, self.fsdp.group)
        return out.view(self.fsdp.world_size, self.piece)

    def reduce_scatter(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        """This rank's rows of each gradient averaged over ranks, in the parameters' dtype.

        ``grads``: one full gradient (any dtype, or None) per parameter, as autograd
        hands them to :meth:`GatherUnit.backward`. Returns one gradient per shard
        (None for a frozen parameter)."""
        n, trainable = self.fsdp.world_size, [p for p in self.params if p.shard.requires_grad]
        if not trainable:
            return [None] * len(self.params)
        dtype = trainable[0].shard.dtype  # the master weights' dtype, whatever was computed
        full = trainable[0].shard.new_zeros(n, self.grad_piece, dtype=dtype)
        by_param = dict(zip(map(id, self.params), grads))
        for p, off in zip(trainable, self.grad_offsets):
            g = by_param[id(p)]
            if g is not None:  # padded to N t rows: rank r's t rows go to row r of `full`
                padded = g.new_zeros(n * p.t, p.row, dtype=dtype)
                padded[: p.rows] = g.reshape(p.rows, p.row)
                full[:, off : off + p.t * p.row] = padded.view(n, p.t * p.row)
        out = full.new_empty(self.grad_piece)
        reduce_scatter_single(out, full.view(-1), self.fsdp.group)
        out /= n
        shard_grads = {
            id(p): out[off : off + (p.end - p.start) * p.row].view(p.shard.shape)
            for p, off in zip(trainable, self.grad_offsets)
        }
        return [shard_grads.get(id(p)) for p in self.params]


def _offsets(sizes: list[int]):
    total = 0
    for size in sizes:
        yield total
        total += size


class _Gathered:
    """One call's full parameters: a flat buffer, parameter after parameter, rows padded."""

    def __init__(self, unit: Unit, dtype: torch.dtype):
        self.unit, self.dtype = unit, dtype
        n = unit.fsdp.world_size
        self.buffer = unit.params[0].shard.new_empty(n * unit.piece, dtype=dtype)
        self.starts = list(_offsets([n * p.t * p.row for p in unit.params]))
        self.fill()

    def views(self) -> tuple[torch.Tensor, ...]:
        """The full parameters: each the first ``rows`` of its ``N t`` padded rows.

        Not kept here: they are :class:`GatherUnit`'s outputs, which refer to this object
        through their autograd node; keeping them would make a cycle that outlives the graph."""
        return tuple(
            self.buffer[s : s + p.rows * p.row].view(p.shape)
            for p, s in zip(self.unit.params, self.starts)
        )

    def fill(self) -> None:
        """All-gather into the buffer (its storage reallocated if it was freed)."""
        storage = self.buffer.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.buffer.numel() * self.buffer.element_size())
        gathered = self.unit.all_gather(self.dtype)  # [N, piece]
        n = self.unit.fsdp.world_size
        # .data: a write autograd's version counter does not see; the saved views are
        # meant to read these values (FSDP2 uses _unsafe_preserve_version_counter).
        flat = self.buffer.data
        for p, off, s in zip(self.unit.params, self.unit.offsets, self.starts):
            flat[s : s + n * p.t * p.row].view(n, p.t * p.row).copy_(
                gathered[:, off : off + p.t * p.row]
            )
        self.unit.fsdp.gathered_now(self)

    @property
    def nbytes(self) -> int:
        """Bytes of full parameters this call holds right now (0 once freed)."""
        return self.buffer.untyped_storage().nbytes()

    def free(self) -> None:
        """Release the buffer's memory; the views keep their shapes, not their values."""
        self.buffer.untyped_storage().resize_(0)

    def before_backward(self, grads: Any = None) -> None:
        """The first gradient of the unit's outputs arrived: all-gather again if freed.

        A unit with nothing trainable has no :meth:`GatherUnit.backward` to free it
        afterwards: the autograd engine frees it once the whole backward is done
        (FSDP2 also reshards what is left in a final callback)."""
        if self.nbytes == 0:
            self.fill()
        if not any(p.shard.requires_grad for p in self.unit.params):
            torch.autograd.Variable._execution_engine.queue_callback(self.free)


class GatherUnit(torch.autograd.Function):
    """Shards in, full parameters out (all-gather); full gradients in, shard gradients
    out (reduce-scatter, averaged over ranks, in the shards' dtype)."""

    @staticmethod
    def forward(ctx, unit: Unit, dtype: torch.dtype, *shards: torch.Tensor):
        ctx.gathered = _Gathered(unit, dtype)
        unit.current = ctx.gathered
        return ctx.gathered.views()

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        gathered = ctx.gathered
        if gathered.nbytes == 0:  # no output needed a gradient: no hook refilled it
            gathered.fill()
        shard_grads = gathered.unit.reduce_scatter(grads)
        gathered.free()  # the unit's backward is over: nothing reads its weights any more
        return (None, None, *shard_grads)


class FSDP(nn.Module):
    """Fully sharded data parallelism around ``module``: its parameters become this
    rank's shards (see the module docstring for the rule, the hooks and the formulas).

    The training loop is the usual one, with any optimizer::

        model = FSDP(net, units=list(net.blocks))   # every rank the same net
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # shards only
        loss_fn(model(x), y).backward()   # shard.grad: averaged over ranks
        opt.step(); opt.zero_grad()

    Args:
        module: the model, on this rank's device, the same on every rank.
        group: process group (default: the world).
        compute_dtype: dtype of the full parameters in forward and backward (e.g.
            ``torch.bfloat16``), cast before the all-gather; floating-point inputs of
            every unit are cast to it too (FSDP2's ``cast_forward_inputs``). ``None``:
            the parameters' dtype.
        reshard_after_forward: free a unit's full parameters after its forward and
            all-gather them again for its backward (FSDP2's default, ZeRO-3; never the
            root's, whose backward starts right after its forward); ``False``
            keeps them until the unit's backward is done: one all-gather per unit per
            step, the whole model's full parameters between forward and backward.
        units: submodules all-gathered each on its own (e.g. the blocks); the root
            gathers what they leave.
        sync_module_states: check that every rank has the same parameter names and
            shapes and broadcast rank 0's parameters and buffers first (``fully_shard``
            does neither: every rank must then build the same model).

    Attributes:
        module: the wrapped model (its parameters are the shards).
        units: the :class:`Unit` s, the root last.
        peak_gathered_bytes: the most bytes of full parameters held at once (storage
            of the gathered buffers, measured at each all-gather; set to 0 to restart).

    Raises:
        RuntimeError: no process group.
        ValueError: a 0-d parameter, a unit mixing dtypes, a parameter tied to modules
            of different units, a unit not inside ``module``, or (with
            ``sync_module_states``) models that differ across ranks.
    """

    def __init__(
        self,
        module: nn.Module,
        group: Any = None,
        compute_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
        units: list[nn.Module] | tuple[nn.Module, ...] = (),
        sync_module_states: bool = True,
    ):
        super().__init__()
        self.group = require_group(group, "FSDP")
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.module, self.compute_dtype = module, compute_dtype
        self.reshard_after_forward = reshard_after_forward
        self.peak_gathered_bytes = 0
        self._live: weakref.WeakSet[_Gathered] = weakref.WeakSet()
        if sync_module_states:
            check_same_shapes(module, self.group)
            broadcast_state(module, self.group)
        self.units = self._make_units(module, units)
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True)
            unit.module.register_forward_hook(self._post_forward(unit))

    def _make_units(self, module: nn.Module, listed) -> list[Unit]:
        names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        listed = [m for m in dict.fromkeys(listed) if m is not module]
        if any(id(m) not in names for m in listed):
            raise ValueError("every unit must be a submodule of the wrapped module")
        units = [Unit(names[id(m)], m, self, is_root=False) for m in listed]
        units.append(Unit("", module, self, is_root=True))
        owner = {}  # id(submodule) -> its innermost unit: outer units first, inner overwrite
        for unit in sorted(units, key=lambda u: -1 if u.is_root else u.name.count(".")):
            for sub in unit.module.modules():
                owner[id(sub)] = unit
        params: dict[int, _Param] = {}
        for name, sub in module.named_modules(remove_duplicate=False):
            for attr, p in list(sub._parameters.items()):
                if p is None:
                    continue
                full_name = f"{name}.{attr}" if name else attr
                if id(p) not in params:
                    params[id(p)] = _Param(full_name, p, self.rank, self.world_size)
                    owner[id(sub)].params.append(params[id(p)])
                elif params[id(p)] not in owner[id(sub)].params:
                    raise ValueError(
                        f"{full_name} is tied to {params[id(p)].name}, which another unit "
                        "gathers: put both modules in one unit (or leave both to the root)"
                    )
                if (sub, attr) not in params[id(p)].slots:
                    params[id(p)].slots.append((sub, attr))
                sub._parameters[attr] = params[id(p)].shard
        units = [u for u in units if u.params]
        for unit in units:
            unit.finish()
        return units

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # -- hooks -------------------------------------------------------------------

    def _pre_forward(self, unit: Unit):
        def hook(module, args, kwargs):
            dtype = self.compute_dtype or unit.params[0].shard.dtype
            full = GatherUnit.apply(unit, dtype, *(p.shard for p in unit.params))
            for p, view in zip(unit.params, full):
                for sub, attr in p.slots:
                    sub.__dict__[attr] = view  # found before nn.Module's _parameters
            if self.compute_dtype is not None:
                args, kwargs = _cast((args, kwargs), self.compute_dtype)
            return args, kwargs

        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            gathered, unit.current = unit.current, None
            for p in unit.params:
                for sub, attr in p.slots:
                    sub.__dict__.pop(attr, None)  # the shard again
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if not outputs:  # no backward will come (torch.no_grad, or nothing trainable)
                gathered.free()
            else:
                if self.reshard_after_forward and not unit.is_root:
                    gathered.free()
                hook = gathered.before_backward
                torch.autograd.graph.register_multi_grad_hook(outputs, hook, mode="any")
            return output

        return hook

    def gathered_now(self, gathered: _Gathered) -> None:
        """Note a buffer just filled; update :attr:`peak_gathered_bytes`."""
        self._live.add(gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def gathered_bytes(self) -> int:
        """Bytes of full parameters this rank holds right now (storage of live buffers)."""
        return sum(g.nbytes for g in self._live)

    # -- formulas and views -------------------------------------------------------

    def step_traffic(self) -> StepTraffic:
        """The collectives one training step should call on this rank, and their bytes
        (module docstring; all-gathers in ``compute_dtype``, reduce-scatters in the
        parameters' dtype)."""
        gathers = gather_bytes = scatters = scatter_bytes = 0
        gathered = self.unit_bytes()
        for u in self.units:
            times = 2 if self.reshard_after_forward and not u.is_root else 1
            gathers += times
            gather_bytes += times * gathered[u.name]
            if u.grad_piece:
                scatters += 1
                scatter_bytes += self.world_size * u.grad_piece * u.params[0].shard.element_size()
        return StepTraffic(gathers, gather_bytes, scatters, scatter_bytes)

    def unit_bytes(self) -> dict[str, int]:
        """Bytes of each unit's gathered buffer in ``compute_dtype``, by unit name (the
        root ``""``): its full parameters with rows padded to ``N t``, as gathered."""
        out = {}
        for u in self.units:
            dtype = self.compute_dtype or u.params[0].shard.dtype
            out[u.name] = self.world_size * u.piece * dtype.itemsize
        return out

    def row_ranges(self) -> dict[str, tuple[int, int]]:
        """``[start, end)`` rows of each parameter this rank owns, by name."""
        return {p.name: (p.start, p.end) for u in self.units for p in u.params}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter by name, in its own dtype, all-gathered (collective:
        call it on every rank; for checkpoints and comparisons)."""
        out = {}
        with torch.no_grad():
            for u in self.units:
                gathered = u.all_gather(u.params[0].shard.dtype)
                for p, off in zip(u.params, u.offsets):
                    rows = gathered[:, off : off + p.t * p.row].reshape(-1, p.row)
                    out[p.name] = rows[: p.rows].reshape(p.shape).clone()
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in (nested) tuples, lists and dicts cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value
