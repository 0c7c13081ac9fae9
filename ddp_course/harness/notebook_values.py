"""Values read out of a notebook's code without running it, for :mod:`.launch_scan`.

Where a launch's rank count or device is a name, the name's value is looked up among every
binding in the notebook (:func:`bindings`): assignments, loop variables, keyword arguments
of the notebook's own functions. :class:`Reader` follows those bindings to the integers an
expression can take (every one of them: more values than run, never fewer), to the device
an ``env=`` mapping sets, to the total ranks of ``torchrun_nodes``' ``Node`` list, and turns
an ``if`` test that compares the machine's GPU count with a number into a :class:`Guard`.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from collections.abc import Iterable

from .. import runtime
from . import multinode

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


def name_of(func: ast.AST) -> str | None:
    """The name a call's function goes by: ``launch.torchrun`` -> ``"torchrun"``,
    ``range`` -> ``"range"``; None for anything else (a subscript, a call)."""
    return getattr(func, "attr", None) or getattr(func, "id", None)


def bindings(trees: Iterable[ast.AST]) -> dict[str, list[ast.AST]]:
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


class Reader:
    """Values of expressions in one notebook, following its bindings.

    Args:
        bindings: :func:`bindings` of every code cell of the notebook.
        local: :func:`bindings` of the cell being read; a name bound there is read from
            these first (``for n in WORLD_SIZES:`` means that loop's values in its cell).
    """

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
        if isinstance(node, ast.Call) and name_of(node.func) == "device_count":
            return True
        return isinstance(node, ast.Name) and any(
            isinstance(n, ast.Call) and name_of(n.func) == "device_count"
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
            if named or name_of(key) == "DEVICE_ENV":
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
        if name_of(node) == "SIMULATED_NODES_DEVICE":
            return multinode.SIMULATED_NODES_DEVICE
        if isinstance(node, ast.Attribute) and node.attr == "device_type" and depth < 5:
            ranks = set()
            for value in self.bindings.get(getattr(node.value, "id", ""), []):
                planned = isinstance(value, ast.Call) and value.args
                if planned and name_of(value.func) in ("device_plan", "sweep_device_plan"):
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
        if not (isinstance(node, ast.Call) and name_of(node.func) == "Node"):
            return set()
        given = node.args[0] if node.args else None
        given = next((k.value for k in node.keywords if k.arg == "nproc"), given)
        return {1} if given is None else self.ints(given)  # Node's default: one rank

    def _iterations(self, node: ast.AST) -> set[int]:
        if isinstance(node, ast.Call) and name_of(node.func) == "range":
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
        if isinstance(test, ast.Call) and name_of(test.func) == "is_available":
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
