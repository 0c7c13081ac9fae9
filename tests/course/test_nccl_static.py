"""Static checks for two bugs that only an nccl process group shows.

CI runs every job on CPUs with gloo, where both of these pass; on GPUs with nccl
the first can hang and the second raises. Both read the source with ``ast``: the
package (``ddp_course/``), the scripts (``scripts/``), every code cell of every
notebook, and every string in those that is itself a Python script (a cell that
writes a script to ``build/`` keeps it in a string: lesson 04's exercise 3).
Notebook cells are read with IPython lines (``%...``, ``!...``) dropped.

**A. Point-to-point pairs outside ``batch_isend_irecv``.** NCCL runs each unbatched
point-to-point call as its own operation on the pair's stream, and a send may wait
until the peer has posted the matching receive (NVIDIA/nccl#783). Two ranks that
each post a receive (or a send) to the other and then the opposite call can wait
for each other forever; ``dist.batch_isend_irecv`` groups them into one operation
that runs both directions at once (NVIDIA/nccl#479). gloo takes the calls one by
one and never shows it. The rule:

- a *p2p call* is a call ``dist.isend``, ``dist.irecv``, ``dist.send`` or
  ``dist.recv`` (``dist`` or ``torch.distributed``); ``dist.isend(...).wait()``
  counts as a blocking ``send``, ``dist.irecv(...).wait()`` as a ``recv``;
  naming one inside ``P2POp(dist.isend, ...)`` is not a call, so everything
  passed to ``batch_isend_irecv`` is exempt by construction;
- a function's p2p calls include those of the functions of the same module it
  calls by name (``_send(...)``, ``self._recv(...)``), transitively, so a send and
  a receive hidden in two helpers still meet in their caller;
- a function (or the module's top level) is **flagged** when it has an ``isend``
  and an ``irecv`` or ``recv`` (in either order), or an ``irecv`` followed (in the
  source, helpers at the line of their call) by a blocking ``send``, that are not
  in opposite branches of one ``if`` (as ``if rank == 0: isend(...) else:
  irecv(...)``, a one-way message). A pair both reached through one call of a
  helper is reported in the helper only.

Two blocking calls (``send`` then ``recv``), and a blocking ``send`` followed by
an ``irecv``, are left alone: they are lesson 03's ordered exchanges (even ranks
send first, odd ranks receive first), and a rule on one function cannot tell
them from every rank sending first, which NCCL, unlike gloo, need not survive
for messages larger than its buffers. The rule cannot see that either, nor: a
pair split over two modules, calls through other names
(``from torch.distributed import isend``, ``getattr``), or an ``if`` whose two
branches do not depend on the rank; and a flagged function may be safe because
its unbatched code never runs on nccl: such code goes in ``GLOO_ONLY`` with the
reason.

**B. A CPU tensor in a collective.** A group made with ``backend="nccl"`` serves
CUDA tensors only (``{'cuda': 'nccl'}``), and refuses a CPU tensor ("No backend
type associated with device type cpu"). The rule, over the scripts and notebook
cells (not the package, whose functions take the tensors they are given): a
tensor made by ``torch.tensor``, ``torch.zeros``, ``torch.ones``, ``torch.empty``,
``torch.full`` or ``torch.arange`` without a ``device=`` keyword, written inline
or assigned to a name, must not be passed to a ``dist.*`` call of the same
function (as a positional argument, in a list or tuple, or as ``tensor=``,
``tensor_list=``, ``input=``, ``output=``, ...), ``dist.P2POp`` included, unless
the name was rebound in between (``t = t.to(ctx.device)``) or the argument moves
it (``t.to(...)``, ``t.cuda()``). ``dist.*_object`` calls move their own tensors
and are not checked. The rule cannot see: a tensor made in one function and
handed to ``torch.distributed`` in another, a ``device=`` that names the CPU, a
tensor made by ``torch.*_like``, ``torch.randn`` or arithmetic on a CPU tensor,
an assignment inside a branch or loop (read in source order), or a group whose
backend serves the CPU (``"gloo"``, ``"cpu:gloo,cuda:nccl"``), where a CPU tensor
is right: such code goes in ``CPU_GROUPS`` with the reason.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SENDS = {"isend": False, "send": True}  # name -> blocking
RECVS = {"irecv": False, "recv": True}
DIST_NAMES = {"dist", "torch.distributed"}

# (source, function) -> why its unbatched point-to-point code never runs on nccl.
GLOO_ONLY: dict[tuple[str, str], str] = {
    ("ddp_course/collectives.py", "_Exchanger.run"): (
        "the isend/irecv loop runs only when self.batched is False, i.e. the group's "
        "backend is not nccl; on nccl the same exchange goes through batch_isend_irecv"
    ),
}


# ----------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class Source:
    """One piece of Python: ``where`` names it in a failure message."""

    where: str
    text: str
    is_package: bool = False


def _cell_code(cell_source: str) -> str:
    """A notebook cell as Python: IPython lines (magics, shell escapes) become blank."""
    lines = cell_source.splitlines()
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def all_sources() -> list[Source]:
    """The package, the scripts and every notebook code cell."""
    found = [
        Source(str(p.relative_to(ROOT)), p.read_text(), True)
        for p in sorted((ROOT / "ddp_course").rglob("*.py"))
    ]
    found += [
        Source(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(ROOT.glob("scripts/*.py"))
    ]
    for nb in sorted(ROOT.glob("notebooks/*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code":
                found.append(Source(f"{nb.name} c{i}", _cell_code("".join(cell["source"]))))
    return found


def embedded_scripts(tree: ast.AST, where: str) -> list[Source]:
    """Strings in ``tree`` that are Python scripts (they parse and define or import)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            try:
                inner = ast.parse(node.value)
            except SyntaxError:
                continue
            if any(
                isinstance(s, (ast.FunctionDef, ast.Import, ast.ImportFrom)) for s in inner.body
            ):
                found.append(Source(f"{where} (string at line {node.lineno})", node.value))
    return found


def parsed(source: Source) -> list[tuple[Source, ast.Module]]:
    """``source`` and the scripts embedded in it, parsed; a syntax error fails the test."""
    tree = ast.parse(source.text)
    out = [(source, tree)]
    for inner in embedded_scripts(tree, source.where):
        out.append((inner, ast.parse(inner.text)))
    return out


# -------------------------------------------------------------- check A


@dataclasses.dataclass(frozen=True)
class Op:
    """A point-to-point call as its function sees it.

    ``branches``: ``(id of an if, "body" or "orelse")`` for every ``if`` around it;
    ``origin``: the line in this function that posts it (its own, or the call of
    the helper that does).
    """

    kind: str  # "send" or "recv"
    name: str
    blocking: bool
    line: int
    branches: tuple[tuple[int, str], ...]
    origin: int


def _is_dist(node: ast.AST) -> bool:
    return ast.unparse(node) in DIST_NAMES


def _local_callee(call: ast.Call) -> str | None:
    """``f(...)`` or ``self.f(...)`` -> ``"f"``."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        if func.value.id in {"self", "cls"}:
            return func.attr
    return None


class _Scope(ast.NodeVisitor):
    """Direct p2p calls and local calls of one function body (nested defs excluded)."""

    def __init__(self):
        self.ops: list[Op] = []
        self.calls: list[tuple[str, int, tuple]] = []  # callee, line, branches
        self._branches: tuple = ()
        self._waited: set[int] = set()

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        outer = self._branches
        for name in ("body", "orelse"):
            self._branches = (*outer, (id(node), name))
            for stmt in getattr(node, name):
                self.visit(stmt)
        self._branches = outer

    def visit_FunctionDef(self, node) -> None:  # a nested def is a scope of its own
        pass

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_ClassDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "wait":
            self._waited.add(id(func.value))  # dist.isend(...).wait() blocks like send
        if isinstance(func, ast.Attribute) and _is_dist(func.value):
            for kind, table in (("send", SENDS), ("recv", RECVS)):
                if func.attr in table:
                    blocking = table[func.attr] or id(node) in self._waited
                    line = node.lineno
                    self.ops.append(Op(kind, func.attr, blocking, line, self._branches, line))
        callee = _local_callee(node)
        if callee is not None:
            self.calls.append((callee, node.lineno, self._branches))
        self.generic_visit(node)


def _scopes(tree: ast.Module) -> dict[str, tuple[ast.AST, list]]:
    """Qualified name -> (node, body) of the module, every function and method."""
    scopes = {"<module>": (tree, tree.body)}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                scopes[name] = (child, child.body)
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            elif not isinstance(child, ast.Lambda):
                walk(child, prefix)

    walk(tree, "")
    return scopes


def _exclusive(a: Op, b: Op) -> bool:
    """Opposite branches of one ``if``: never both run on one rank in one pass."""
    mine = dict(a.branches)
    return any(k in mine and mine[k] != side for k, side in b.branches)


def _effective(name, direct, calls, by_short, seen=()) -> list[Op]:
    """``name``'s p2p calls and those of the local functions it calls, transitively."""
    ops = list(direct[name])
    for callee, line, branches in calls[name]:
        for target in by_short.get(callee, []):
            if target in seen or target == name:
                continue
            for op in _effective(target, direct, calls, by_short, (*seen, name)):
                ops.append(dataclasses.replace(op, branches=branches + op.branches, origin=line))
    return ops


def _hazard(send: Op, recv: Op) -> bool:
    """Rule A for one send and one receive of a function (see the module docstring)."""
    if _exclusive(send, recv):
        return False
    if send.origin == recv.origin and (send.line, recv.line) != (send.origin, recv.origin):
        return False  # both inside one helper call: reported in the helper
    if not send.blocking:
        return True  # isend with irecv or recv, in either order
    # irecv, then a blocking send: on nccl the send is queued behind the receive.
    return not recv.blocking and (recv.origin, recv.line) < (send.origin, send.line)


@dataclasses.dataclass(frozen=True)
class Unbatched:
    """A flagged send/receive pair of check A."""

    where: str
    function: str
    send: Op
    recv: Op

    def __str__(self) -> str:
        return (
            f"{self.where}: {self.function} posts dist.{self.send.name} (line {self.send.line}) "
            f"and dist.{self.recv.name} (line {self.recv.line}) outside batch_isend_irecv"
        )


def unbatched_pairs(source: Source) -> list[Unbatched]:
    """Check A over ``source`` and the scripts embedded in it (see the module docstring)."""
    found = []
    for src, tree in parsed(source):
        scopes = _scopes(tree)
        direct, calls = {}, {}
        for name, (_, body) in scopes.items():
            visitor = _Scope()
            for stmt in body:
                visitor.visit(stmt)
            direct[name], calls[name] = visitor.ops, visitor.calls
        by_short = {}
        for name in scopes:
            by_short.setdefault(name.rsplit(".", 1)[-1], []).append(name)

        for name in scopes:
            ops = _effective(name, direct, calls, by_short)
            sends = [o for o in ops if o.kind == "send"]
            recvs = [o for o in ops if o.kind == "recv"]
            for s in sends:
                pair = next((r for r in recvs if _hazard(s, r)), None)
                if pair is not None:
                    found.append(Unbatched(src.where, name, s, pair))
                    break
    return found


# The solution to lesson 04's exercise 3 as it was first written: a ring whose
# irecv and isend, posted as two calls, wait for each other on nccl at 2 ranks.
OLD_NAIVE_RING = '''
NAIVE_RING = """
import torch
import torch.distributed as dist


def naive_ring_all_reduce(tensor, group):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    right = dist.get_global_rank(group, (rank + 1) % n)
    left = dist.get_global_rank(group, (rank - 1) % n)
    passing, incoming = tensor.clone(), torch.empty_like(tensor)
    for _ in range(n - 1):
        works = [dist.irecv(incoming, left, group), dist.isend(passing, right, group)]
        for work in works:
            work.wait()
        tensor += incoming
        passing, incoming = incoming, passing
"""
naive_path = BUILD / "04_naive_ring.py"
naive_path.write_text(NAIVE_RING)
'''


def test_check_a_flags_the_old_exercise_3_ring():
    found = unbatched_pairs(Source("04_allreduce.ipynb c58", OLD_NAIVE_RING))
    assert [(f.function, f.send.name, f.recv.name) for f in found] == [
        ("naive_ring_all_reduce", "isend", "irecv")
    ], found
    assert "(string at line 2)" in found[0].where


CHECK_A_CASES = [
    # The fix: both calls named in P2POp, posted by batch_isend_irecv.
    (
        "ops = [dist.P2POp(dist.irecv, a, 0), dist.P2POp(dist.isend, b, 1)]\n"
        "for w in dist.batch_isend_irecv(ops):\n    w.wait()\n",
        False,
    ),
    # Waited at once: blocking calls (lesson 03's isend demo beside its ordered ring).
    ("dist.isend(t, 1).wait()\ndist.recv(t, 1)\n", False),
    # One way, by rank: never a pair on one rank.
    ("if rank == 0:\n    dist.isend(t, 1).wait()\nelse:\n    dist.irecv(t, 0).wait()\n", False),
    # Two blocking calls: lesson 03's ordered ring, gloo deadlocks alike.
    ("dist.send(t, 1)\ndist.recv(t, 0)\n", False),
    # A blocking send, then a one-way irecv later on (lesson 03's demos).
    ("dist.send(t, 1)\nw = dist.irecv(t, 0)\n", False),
    # An irecv, then a blocking send: queued behind the receive on nccl.
    ("w = dist.irecv(t, 0)\ndist.send(t, 1)\nw.wait()\n", True),
    # A non-blocking send and a blocking receive (lesson 08's executor as it was).
    ("w = dist.isend(t, 1)\ndist.recv(r, 1)\nw.wait()\n", True),
    # ... even when each sits in a helper of its own.
    (
        "def _send(t, p):\n    return dist.isend(t, p)\n"
        "def _recv(t, p):\n    torch.distributed.recv(t, p)\n"
        "def step(t, r):\n    w = _send(t, 1)\n    _recv(r, 1)\n",
        True,
    ),
    # Branches by rank around a pair on each side: still a pair on each rank.
    ("if rank:\n    dist.irecv(a, 0)\n    dist.isend(b, 0)\n", True),
]


def test_check_a_sees_a_pair_split_over_helpers_once():
    code = (
        "def _send(t, p):\n    return dist.isend(t, p)\n"
        "def _recv(t, p):\n    dist.recv(t, p)\n"
        "def step(t, r):\n    w = _send(t, 1)\n    _recv(r, 1)\n"
        "def loop(t, r):\n    step(t, r)\n"
    )
    assert [f.function for f in unbatched_pairs(Source("example", code))] == ["step"]


def found_beyond(check, allowed: dict, name: str, package: bool = True) -> list[str]:
    """What ``check`` finds in every source (the package's too when ``package``), less the
    ``(where, function)`` keys of ``allowed`` (named ``name``), each of which it must find."""
    flagged, seen = [], set()
    for source in all_sources():
        if source.is_package and not package:
            continue
        for found in check(source):
            key = (found.where, found.function)
            if key in allowed:
                seen.add(key)
            else:
                flagged.append(str(found))
    assert seen == set(allowed), f"stale {name} entries: {set(allowed) - seen}"
    return flagged


def test_no_unbatched_point_to_point_pair_that_can_run_on_nccl():
    flagged = found_beyond(unbatched_pairs, GLOO_ONLY, "GLOO_ONLY")
    assert not flagged, "use dist.batch_isend_irecv (see the module docstring):\n" + "\n".join(
        flagged
    )


# -------------------------------------------------------------- check B

FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange"}
TENSOR_KEYWORDS = {"tensor", "tensor_list", "output", "input", "output_tensor", "input_tensor"}

# (source, function) -> why the CPU tensor it hands to torch.distributed is right there.
CPU_GROUPS: dict[tuple[str, str], str] = {
    ("12_debugging.ipynb c23 (string at line 1)", "<module>"): (
        "the flight-recorder probe makes its own gloo group of one "
        '(init_process_group("gloo", store=HashStore())) on every machine'
    ),
}


def _cpu_factory(node: ast.AST) -> bool:
    """``torch.zeros(...)`` and its kin without ``device=``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in FACTORIES
        and ast.unparse(node.func.value) == "torch"
        and not any(k.arg == "device" for k in node.keywords)
    )


def _own_nodes(body: list[ast.stmt]):
    """Every node of a function body, nested defs and classes excluded."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


@dataclasses.dataclass(frozen=True)
class CpuTensor:
    """A flagged tensor of check B: made on ``made`` (a line), handed to ``call`` on ``line``."""

    where: str
    function: str
    call: str
    line: int
    made: int

    def __str__(self) -> str:
        return (
            f"{self.where}: {self.function} passes a tensor made without device= "
            f"(line {self.made}) to dist.{self.call} (line {self.line})"
        )


def _targets(node: ast.AST) -> list[str]:
    """Names an assignment rebinds (``t[:] = ...`` and ``a.t = ...`` rebind none)."""
    names = []
    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        items = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        names += [t.id for t in items if isinstance(t, ast.Name)]
    return names


def cpu_tensors_in_collectives(source: Source) -> list[CpuTensor]:
    """Check B over ``source`` and the scripts embedded in it (see the module docstring)."""
    found = []
    for src, tree in parsed(source):
        for name, (_, body) in _scopes(tree).items():
            events = []  # (line, col, kind, node)
            for node in _own_nodes(body):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    events.append((node.end_lineno, node.end_col_offset, "bind", node))
                elif isinstance(node, (ast.For, ast.With)):
                    for t in [node.target] if isinstance(node, ast.For) else node.items:
                        target = t if isinstance(node, ast.For) else t.optional_vars
                        if target is not None:
                            events.append((node.lineno, node.col_offset, "unbind", target))
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and _is_dist(node.func.value)
                    and not node.func.attr.endswith("_object")
                ):
                    events.append((node.lineno, node.col_offset, "call", node))
            cpu: dict[str, int] = {}
            for line, _, kind, node in sorted(events, key=lambda e: e[:2]):
                if kind == "bind":
                    names = _targets(node)
                    for n in names:
                        cpu.pop(n, None)
                    if _cpu_factory(node.value) and len(names) == 1:
                        cpu[names[0]] = node.lineno
                elif kind == "unbind":
                    for n in ast.walk(node):
                        if isinstance(n, ast.Name):
                            cpu.pop(n.id, None)
                else:
                    args = list(node.args) + [
                        k.value for k in node.keywords if k.arg in TENSOR_KEYWORDS
                    ]
                    for arg in args:
                        items = arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
                        for item in items:
                            made = None
                            if isinstance(item, ast.Name) and item.id in cpu:
                                made = cpu[item.id]
                            elif _cpu_factory(item):
                                made = item.lineno
                            if made is not None:
                                found.append(CpuTensor(src.where, name, node.func.attr, line, made))
    return found


# scripts/15_moe.py as it was first written: a float64 CPU tensor all-reduced, which
# an nccl group refuses ("No backend type associated with device type cpu").
OLD_15_MOE = """
import torch
import torch.distributed as dist


def max_over_ranks(value):
    t = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
"""


def test_check_b_flags_the_old_15_moe():
    found = cpu_tensors_in_collectives(Source("scripts/15_moe.py", OLD_15_MOE))
    assert [(f.function, f.call, f.made, f.line) for f in found] == [
        ("max_over_ranks", "all_reduce", 7, 8)
    ], found


CHECK_B_CASES = [
    ("t = torch.tensor(1.0, device=ctx.device)\ndist.all_reduce(t)\n", False),
    ("t = torch.zeros(3)\nt = t.to(ctx.device)\ndist.all_reduce(t)\n", False),
    ("t = torch.zeros(3)\ndist.all_reduce(t.to(dev))\n", False),
    ("t = torch.zeros(3)\ndist.all_gather_object(out, t)\n", False),
    ("t = torch.ones(3)\ndist.broadcast(t, src=0)\n", True),
    (
        "out = [torch.empty(2) for _ in range(2)]\nt = torch.arange(2)\ndist.all_gather(out, t)\n",
        True,
    ),
    ("dist.all_reduce(torch.full((2,), 1.0))\n", True),
    # Filled in place from a CPU tensor: t itself stays where it was made.
    (
        "t = torch.zeros(2, device=d)\nt[:] = torch.tensor([1, 2])\ndist.broadcast(t, 0)\n",
        False,
    ),
    ("t = torch.zeros(3)\nops = [dist.P2POp(dist.isend, t, 1)]\n", True),
]


@pytest.mark.parametrize(
    "check, code, flagged",
    [(unbatched_pairs, *case) for case in CHECK_A_CASES]
    + [(cpu_tensors_in_collectives, *case) for case in CHECK_B_CASES],
)
def test_check_rules(check, code, flagged):
    assert bool(check(Source("example", code))) is flagged


def test_no_cpu_tensor_reaches_a_collective_in_scripts_or_notebooks():
    flagged = found_beyond(cpu_tensors_in_collectives, CPU_GROUPS, "CPU_GROUPS", package=False)
    assert not flagged, "give it device=ctx.device (see the module docstring):\n" + "\n".join(
        flagged
    )


# ------------------------------------------- what a lesson shows of one backend


def _notebook_cells(name: str) -> list[str]:
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


# Jobs whose point is gloo's behaviour: they run on the CPU with gloo whatever the GPUs.
GLOO_JOBS = {
    ("06_samplers.ipynb", "../build/06_join_loss.py"): (
        "exercise 3 shows gloo's size check on mismatched collectives; with nccl the "
        "outcome is undefined (a hang, a crash or wrong numbers)"
    ),
}


@pytest.mark.parametrize("notebook, script", sorted(GLOO_JOBS))
def test_jobs_about_gloo_run_on_the_cpu(notebook, script):
    launches = []
    for cell in _notebook_cells(notebook):
        for node in ast.walk(ast.parse(_cell_code(cell))):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func).endswith("torchrun")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == script
            ):
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                launches.append(keywords)
    assert launches, f"no launch of {script} in {notebook}"
    for keywords in launches:
        forced = keywords.get("gpus") == "0" or "'DDP_COURSE_DEVICE': 'cpu'" in keywords.get(
            "env", ""
        )
        assert forced, f"{script}: pass gpus=0 ({GLOO_JOBS[notebook, script]})"


def _label_bodies(tree: ast.AST, label: str) -> list[list[ast.stmt]]:
    bodies = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if (
                    isinstance(call, ast.Call)
                    and ast.unparse(call.func) == "record_function"
                    and [ast.unparse(a) for a in call.args] == [repr(label)]
                ):
                    bodies.append(node.body)
    return bodies


def test_12_monitor_backward_label_holds_the_gpu_wait():
    """nccl's backward returns before its all-reduce is done: sync inside the label.

    Otherwise the fast rank's wait for the straggler falls after the "backward"
    label closes, and lesson 12's profile shows it nowhere.
    """
    tree = ast.parse((ROOT / "scripts" / "12_monitor.py").read_text())
    bodies = _label_bodies(tree, "backward")
    assert len(bodies) == 1
    calls = {ast.unparse(n.func) for s in bodies[0] for n in ast.walk(s) if isinstance(n, ast.Call)}
    assert "loss.backward" in calls and "torch.cuda.synchronize" in calls, calls
