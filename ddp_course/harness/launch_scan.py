"""Every way a notebook starts ranks or touches a GPU, read from its code without running it.

A notebook reaches a GPU through four doors, each with its own device rule:

- ``launch.torchrun(script, nproc=N, gpus=G, env=...)``: the launcher's plan,
  :func:`ddp_course.runtime.device_plan` of N ranks on the machine's GPUs (or on ``G``),
  unless ``env`` sets ``DDP_COURSE_DEVICE``; ``nproc`` read from the cell (a number, a
  name bound to numbers anywhere in the notebook), or one rank per GPU
  (``nproc=gpus`` with ``gpus = torch.cuda.device_count()``);
- ``multinode.torchrun_nodes(script, args, [Node(nproc=...), ...])``: the sum of the nodes'
  ranks, always on :data:`ddp_course.harness.multinode.SIMULATED_NODES_DEVICE` (the
  simulated nodes share one machine's GPUs; why in ``SIMULATED_NODES_REASON``);
- ``launch.python(script, reference_for=K, gpus=G)``: one process on the device a rank of a
  K-rank job gets (K = 1: a plain run, on a GPU whenever there is one);
- ``torch.cuda.*`` calls (other than the queries ``is_available`` and ``device_count``)
  and ``.cuda()`` in the notebook's own kernel: CUDA whenever the machine has a GPU.

Each found call is a :class:`Launch`. ``if`` statements around it that compare the
machine's GPU count with a number (``if gpus >= 2:``, ``if torch.cuda.is_available():``,
``else`` branches too) become its :class:`Guard`\\ s, so a launch in a GPU-only branch is
not counted where that branch does not run. Other conditions are not read: the launch
counts as reachable (more launches than run, never fewer).

``%%writefile`` cells are scripts, not notebook code: what they do on a device is what
their launch decides. ``python -m ddp_course gpu-check`` uses :func:`cuda_notebooks` to
choose the notebooks that have a CUDA path on a machine's GPU count; the multi-process
tests use :func:`scan` to check that every launch has a runnable device plan.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import pathlib
from collections.abc import Iterable, Mapping, Sequence

from .. import runtime
from . import multinode

KINDS = ("torchrun", "torchrun_nodes", "python", "torch.cuda")
# torch.cuda calls that only ask, and run on a machine without a GPU too.
CUDA_QUERIES = frozenset({"is_available", "device_count"})
# torchrun_nodes' default nodes: two of one rank each.
DEFAULT_NODE_RANKS = 2
_OPS = {
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}
_FLIPPED = {ast.Gt: ast.Lt, ast.GtE: ast.LtE, ast.Lt: ast.Gt, ast.LtE: ast.GtE}
_SYMBOLS = {ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}


@dataclasses.dataclass(frozen=True)
class Guard:
    """``if gpus <op> value`` around a launch: the launch runs where the comparison of the
    machine's GPU count with ``value`` is ``expected`` (``False`` in an ``else`` branch)."""

    op: str  # one of ">", ">=", "<", "<=", "==", "!="
    value: int
    expected: bool = True

    def allows(self, gpus: int) -> bool:
        """Whether the branch runs on a machine with ``gpus`` GPUs."""
        ops = {_SYMBOLS[k]: f for k, f in _OPS.items()}
        return ops[self.op](gpus, self.value) == self.expected


@dataclasses.dataclass(frozen=True)
class Launch:
    """One call of a notebook that starts processes or uses CUDA in its kernel.

    Attributes:
        notebook: file name, ``"05_ddp.ipynb"``.
        cell: 0-based index of the cell in ``nb["cells"]``.
        line: line of the call in the cell (1-based).
        kind: one of :data:`KINDS`.
        nproc: the rank counts it can start with (every value a name in ``nproc=`` is bound
            to); ``()`` when sized from the GPUs (see ``per_gpu``).
        per_gpu: ``nproc`` is the machine's GPU count plus this (``nproc=gpus`` is 0); None
            otherwise.
        gpus: the ``gpus=`` argument (the plan's GPU count instead of the machine's), or None.
        device: a device type forced on the job (``DDP_COURSE_DEVICE`` in ``env``, or the
            simulated nodes' device), or None: the plan decides.
        plan_ranks: the job runs where the notebook's own plan of this many ranks says
            (``env={DEVICE_ENV: plan.device_type}``, one plan for a sweep), or None.
        guards: conditions on the machine's GPU count under which the call runs.
    """

    notebook: str
    cell: int
    line: int
    kind: str
    nproc: tuple[int, ...]
    per_gpu: int | None = None
    gpus: int | None = None
    device: str | None = None
    plan_ranks: int | None = None
    guards: tuple[Guard, ...] = ()

    def runs_with(self, gpus: int) -> bool:
        """Whether the call runs on a machine with ``gpus`` GPUs (every guard allows it;
        ``torch.cuda`` calls need a GPU)."""
        if self.kind == "torch.cuda" and gpus == 0:
            return False
        return all(g.allows(gpus) for g in self.guards)

    def ranks(self, gpus: int) -> list[int]:
        """The rank counts it starts with on a machine with ``gpus`` GPUs (``[]`` where it
        does not run)."""
        if not self.runs_with(gpus):
            return []
        if self.per_gpu is not None:
            return [gpus + self.per_gpu] if gpus + self.per_gpu >= 1 else []
        return list(self.nproc)

    def device_type(self, nproc: int, gpus: int) -> str:
        """``"cuda"`` or ``"cpu"``: where a job of ``nproc`` ranks of this call runs on a
        machine with ``gpus`` GPUs."""
        if self.device is not None:
            return self.device
        if self.plan_ranks is not None:
            return runtime.device_plan(self.plan_ranks, gpus).device_type
        if self.kind == "torch.cuda":
            return "cuda" if gpus else "cpu"
        return runtime.device_plan(nproc, gpus if self.gpus is None else self.gpus).device_type

    def device_types(self, gpus: int) -> set[str]:
        """Every device type the call uses on a machine with ``gpus`` GPUs."""
        return {self.device_type(n, gpus) for n in self.ranks(gpus)}

    def fails_on_purpose(self, gpus: int) -> bool:
        """A job that forces CUDA on more ranks than GPUs: a lesson showing the error a
        rank without a GPU gets (lesson 12)."""
        return self.device == "cuda" and any(n > gpus for n in self.ranks(gpus))

    def where(self) -> str:
        """``"05_ddp.ipynb c14 line 3"``."""
        return f"{self.notebook} c{self.cell} line {self.line}"


def code_of(cell: Mapping) -> str:
    """A code cell's Python: ``""`` for a cell magic (``%%writefile`` is a script, not
    notebook code); line magics and shell lines (``%``, ``!``) blanked, so line numbers
    stay those of the cell."""
    lines = "".join(cell["source"]).splitlines()
    if lines and lines[0].startswith("%%"):
        return ""
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines)


def _name(func: ast.AST) -> str | None:
    return getattr(func, "attr", None) or getattr(func, "id", None)


def _bindings(trees: Iterable[ast.AST]) -> dict[str, list[ast.AST]]:
    """Every expression bound to a name anywhere in the notebook: assignments, loop and
    comprehension variables, and keyword arguments of the notebook's own functions
    (``short_run(nproc=1)`` binds ``short_run``'s parameter ``nproc``)."""
    trees = list(trees)
    bound: dict[str, list[ast.AST]] = {}
    params = {
        node.name: {a.arg for a in node.args.args + node.args.kwonlyargs}
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
    }
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        bound.setdefault(target.id, []).append(node.value)
            elif isinstance(node, ast.For | ast.comprehension):
                if isinstance(node.target, ast.Name):
                    bound.setdefault(node.target.id, []).append(node.iter)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in params:
                for keyword in node.keywords:
                    if keyword.arg in params[node.func.id]:
                        bound.setdefault(keyword.arg, []).append(keyword.value)
    return bound


class _Reader:
    """Values of expressions in one notebook, following its bindings."""

    def __init__(
        self, bindings: dict[str, list[ast.AST]], local: dict[str, list[ast.AST]] | None = None
    ):
        self.bindings = bindings
        self.local = local or {}

    def ints(self, node: ast.AST, depth: int = 0) -> set[int]:
        """The integers an expression can take (every binding of a name: more values
        than run, never fewer)."""
        if depth > 5:
            return set()
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return {node.value}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return set().union(*(self.ints(e, depth + 1) for e in node.elts))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "range":
            try:
                return set(range(*(ast.literal_eval(a) for a in node.args)))
            except ValueError:
                return set()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
            # ``2 * NPROC_PER_NODE``: every combination of the two sides' values.
            left, right = self.ints(node.left, depth + 1), self.ints(node.right, depth + 1)
            combine = operator.add if isinstance(node.op, ast.Add) else operator.mul
            return {combine(a, b) for a in left for b in right}
        if isinstance(node, ast.Name):
            # A name bound in the cell itself (``for n in WORLD_SIZES:``) means that binding
            # where it can be read; else every binding in the notebook.
            for bindings in (self.local, self.bindings):
                found: set[int] = set()
                for value in bindings.get(node.id, []):
                    found |= self.ints(value, depth + 1)
                if found:
                    return found
        return set()

    def is_gpu_count(self, node: ast.AST) -> bool:
        """``torch.cuda.device_count()``, or a name bound to an expression that calls it."""
        if isinstance(node, ast.Call) and _name(node.func) == "device_count":
            return True
        return isinstance(node, ast.Name) and any(
            isinstance(n, ast.Call) and _name(n.func) == "device_count"
            for value in self.bindings.get(node.id, [])
            for n in ast.walk(value)
        )

    def reads_gpu_count(self, node: ast.AST) -> bool:
        """Whether the expression reads the machine's GPU count anywhere."""
        return any(self.is_gpu_count(n) for n in ast.walk(node))

    def per_gpu(self, node: ast.AST) -> int | None:
        """``gpus`` -> 0, ``gpus + 1`` -> 1, ``gpus - 1`` -> -1; None for anything else."""
        if self.is_gpu_count(node):
            return 0
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Add | ast.Sub)
            and self.is_gpu_count(node.left)
            and isinstance(node.right, ast.Constant)
            and isinstance(node.right.value, int)
        ):
            return node.right.value if isinstance(node.op, ast.Add) else -node.right.value
        return None

    def device(self, node: ast.AST | None, depth: int = 0) -> str | int | None:
        """What an ``env=`` mapping sets ``DDP_COURSE_DEVICE`` to: a device type, the
        rank count of a plan the notebook made itself (``env={DEVICE_ENV:
        plan.device_type}`` with ``plan = sweep_device_plan(SIZES, gpus)``: the plan of
        ``max(SIZES)`` ranks), or None where it does not set it.

        Raises:
            ValueError: the mapping sets it to something this reader cannot follow.
        """
        if node is None or depth > 5:
            return None
        if isinstance(node, ast.Name):
            found = {self.device(v, depth + 1) for v in self.bindings.get(node.id, [])}
            found.discard(None)
            if len(found) > 1:
                raise ValueError(f"{node.id} sets {runtime.DEVICE_ENV} to {sorted(found)}")
            return found.pop() if found else None
        if not isinstance(node, ast.Dict):
            return None
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                continue
            named = isinstance(key, ast.Constant) and key.value == runtime.DEVICE_ENV
            if named or _name(key) == "DEVICE_ENV":
                return self.text(value, depth + 1)
        return None

    def text(self, node: ast.AST, depth: int = 0) -> str | int:
        """A device: a string constant, ``multinode.SIMULATED_NODES_DEVICE``, a name bound
        to one, or ``plan.device_type`` of a ``plan`` bound to ``device_plan(N, ...)`` or
        ``sweep_device_plan(SIZES, ...)`` (then the largest rank count, an int).

        Raises:
            ValueError: none of these.
        """
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if _name(node) == "SIMULATED_NODES_DEVICE":
            return multinode.SIMULATED_NODES_DEVICE
        if isinstance(node, ast.Attribute) and node.attr == "device_type" and depth < 5:
            ranks = set()
            for value in self.bindings.get(getattr(node.value, "id", ""), []):
                planned = isinstance(value, ast.Call) and value.args
                if planned and _name(value.func) in ("device_plan", "sweep_device_plan"):
                    ranks |= self.ints(value.args[0])
            if ranks:
                return max(ranks)
        if isinstance(node, ast.Name) and depth < 5:
            values = {self.text(v, depth + 1) for v in self.bindings.get(node.id, [])}
            if len(values) == 1:
                return values.pop()
        raise ValueError(f"cannot read the device {ast.unparse(node)!r}")

    def node_ranks(self, node: ast.AST | None, depth: int = 0) -> set[int]:
        """Total ranks of a ``nodes`` argument of ``torchrun_nodes`` (every value it can
        take); an empty set where it cannot be read."""
        if node is None:
            return {DEFAULT_NODE_RANKS}
        if depth > 5:
            return set()
        if isinstance(node, ast.List | ast.Tuple):
            totals = {0}
            for element in node.elts:
                each = self._node_nproc(element)
                totals = {t + n for t in totals for n in each}
            return totals
        if isinstance(node, ast.ListComp) and len(node.generators) == 1:
            each, count = self._node_nproc(node.elt), self._iterations(node.generators[0].iter)
            return {n * c for n in each for c in count}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            times = self.ints(node.right, depth + 1)
            return {t * k for t in self.node_ranks(node.left, depth + 1) for k in times}
        if isinstance(node, ast.Name):
            found: set[int] = set()
            for value in self.bindings.get(node.id, []):
                found |= self.node_ranks(value, depth + 1)
            return found
        return set()

    def _node_nproc(self, node: ast.AST) -> set[int]:
        if not (isinstance(node, ast.Call) and _name(node.func) == "Node"):
            return set()
        given = node.args[0] if node.args else None
        given = next((k.value for k in node.keywords if k.arg == "nproc"), given)
        return {1} if given is None else self.ints(given)  # Node's default: one rank

    def _iterations(self, node: ast.AST) -> set[int]:
        if isinstance(node, ast.Call) and _name(node.func) == "range":
            try:
                return {len(range(*(ast.literal_eval(a) for a in node.args)))}
            except ValueError:
                return set()
        if isinstance(node, ast.List | ast.Tuple):
            return {len(node.elts)}
        return set()

    def guard(self, test: ast.AST) -> Guard | None:
        """An ``if`` test as a condition on the machine's GPU count; None where it is not one."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self.guard(test.operand)
            if inner is None:
                return None
            return dataclasses.replace(inner, expected=not inner.expected)
        if isinstance(test, ast.Call) and _name(test.func) == "is_available":
            return Guard(">", 0)
        if self.is_gpu_count(test):  # ``if gpus:``
            return Guard(">", 0)
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, op, right = test.left, type(test.ops[0]), test.comparators[0]
            if op not in _OPS:
                return None
            if not self.is_gpu_count(left):  # ``2 <= gpus``
                left, right, op = right, left, _FLIPPED.get(op, op)
            if self.is_gpu_count(left) and isinstance(right, ast.Constant):
                if isinstance(right.value, int):
                    return Guard(_SYMBOLS[op], right.value)
        return None


def _calls(node: ast.AST, guards: tuple[Guard, ...], reader: _Reader):
    """``(call, guards)`` for every call in ``node``, with the GPU-count conditions of the
    ``if`` statements around it."""
    if isinstance(node, ast.If):
        yield from _calls(node.test, guards, reader)
        guard = reader.guard(node.test)
        inside = guards + ((guard,) if guard else ())
        other = guards + (
            (dataclasses.replace(guard, expected=not guard.expected),) if guard else ()
        )
        for child in node.body:
            yield from _calls(child, inside, reader)
        for child in node.orelse:
            yield from _calls(child, other, reader)
        return
    if isinstance(node, ast.Call):
        yield node, guards
    for child in ast.iter_child_nodes(node):
        yield from _calls(child, guards, reader)


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _constant_gpus(call: ast.Call, reader: _Reader, where: str) -> int | None:
    node = _keyword(call, "gpus")
    if node is None:
        return None
    values = reader.ints(node)
    if len(values) != 1:
        raise ValueError(f"{where}: cannot read gpus={ast.unparse(node)}; give it a number")
    return values.pop()


def _launch(
    call: ast.Call, guards: tuple[Guard, ...], reader: _Reader, notebook: str, cell: int
) -> Launch | None:
    """The :class:`Launch` a call is, or None for any other call.

    Raises:
        ValueError: a launch whose ranks or device cannot be read (the message says where).
    """
    name = _name(call.func)
    where = f"{notebook} cell {cell} line {call.lineno}"
    base = dict(notebook=notebook, cell=cell, line=call.lineno, guards=guards)
    func = ast.unparse(call.func)
    if name == "torchrun" or (name == "python" and func.endswith("launch.python")):
        try:
            device = reader.device(_keyword(call, "env"))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if isinstance(device, int):
            base.update(plan_ranks=device)
        else:
            base.update(device=device)
    if name == "torchrun":
        nproc = _keyword(call, "nproc")
        gpus = _constant_gpus(call, reader, where)
        if nproc is not None and reader.reads_gpu_count(nproc):
            per_gpu = reader.per_gpu(nproc)
            if per_gpu is None:
                raise ValueError(f"{where}: nproc={ast.unparse(nproc)} is not one rank per GPU")
            return Launch(kind="torchrun", nproc=(), per_gpu=per_gpu, gpus=gpus, **base)
        values = {2} if nproc is None else reader.ints(nproc)  # 2: torchrun's default here
        if not values:
            raise ValueError(
                f"{where}: cannot read nproc={ast.unparse(nproc)}; give it a number or a "
                "name assigned a number in the notebook"
            )
        return Launch(kind="torchrun", nproc=tuple(sorted(values)), gpus=gpus, **base)
    if name == "torchrun_nodes":
        nodes = call.args[2] if len(call.args) > 2 else _keyword(call, "nodes")
        totals = reader.node_ranks(nodes)
        if not totals:
            raise ValueError(f"{where}: cannot read the nodes' ranks of {ast.unparse(nodes)}")
        return Launch(kind="torchrun_nodes", nproc=tuple(sorted(totals)),
                      device=multinode.SIMULATED_NODES_DEVICE, **base)  # fmt: skip
    if name == "python" and func.endswith("launch.python"):
        ref = _keyword(call, "reference_for")
        values = {1} if ref is None else reader.ints(ref)
        if not values:
            raise ValueError(f"{where}: cannot read reference_for={ast.unparse(ref)}")
        gpus = _constant_gpus(call, reader, where)
        return Launch(kind="python", nproc=tuple(sorted(values)), gpus=gpus, **base)
    cuda_call = func.startswith("torch.cuda.") and name not in CUDA_QUERIES
    if cuda_call or (name == "cuda" and func != "torch.cuda"):
        return Launch(kind="torch.cuda", nproc=(1,), **base)
    return None


def notebook_launches(path: pathlib.Path) -> list[Launch]:
    """Every :class:`Launch` in one notebook, in cell order; at most one ``torch.cuda``
    entry a cell (its first use).

    Raises:
        ValueError: a code cell that is not Python, or a launch whose ranks or device
            cannot be read (the message names the notebook, cell and line).
    """
    cells = json.loads(pathlib.Path(path).read_text())["cells"]
    trees: dict[int, ast.AST] = {}
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        try:
            trees[i] = ast.parse(code_of(cell))
        except SyntaxError as exc:
            raise ValueError(f"{path.name} cell {i} is not Python: {exc}") from None
    everywhere = _bindings(trees.values())
    found = []
    for i, tree in trees.items():
        reader = _Reader(everywhere, _bindings([tree]))
        cuda_seen = False
        for call, guards in _calls(tree, (), reader):
            launch = _launch(call, guards, reader, path.name, i)
            if launch is None or (launch.kind == "torch.cuda" and cuda_seen):
                continue
            cuda_seen = cuda_seen or launch.kind == "torch.cuda"
            found.append(launch)
    return found


def scan(folder: pathlib.Path) -> list[Launch]:
    """:func:`notebook_launches` of every ``NN_*.ipynb`` in ``folder``, in file order."""
    return [launch for path in sorted(folder.glob("[0-9][0-9]_*.ipynb"))
            for launch in notebook_launches(path)]  # fmt: skip


def cuda_notebooks(launches: Sequence[Launch], gpus: int) -> list[str]:
    """The notebooks with a CUDA path on a machine with ``gpus`` GPUs: at least one launch
    that runs there on ``cuda``; sorted by name."""
    return sorted({x.notebook for x in launches if "cuda" in x.device_types(gpus)})


def nccl_notebooks(launches: Sequence[Launch], gpus: int) -> list[str]:
    """The notebooks that start a job of 2 or more ranks on ``cuda`` (an nccl group that
    talks between GPUs) on a machine with ``gpus`` GPUs; sorted by name."""
    return sorted({
        x.notebook for x in launches if x.kind != "torch.cuda" and not x.fails_on_purpose(gpus)
        for n in x.ranks(gpus) if n >= 2 and x.device_type(n, gpus) == "cuda"
    })  # fmt: skip
