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
``else`` branches too) become its :class:`~ddp_course.harness.notebook_values.Guard`\\ s,
so a launch in a GPU-only branch is not counted where that branch does not run. Other
conditions are not read: the launch counts as reachable (more launches than run, never
fewer). Names, conditions and ``env=`` mappings are read by
:mod:`ddp_course.harness.notebook_values`.

``%%writefile`` cells are scripts, not notebook code: what they do on a device is what
their launch decides. ``python -m ddp_course gpu-check`` uses :func:`cuda_notebooks` to
choose the notebooks that have a CUDA path on a machine's GPU count; the multi-process
tests use :func:`scan` to check that every launch has a runnable device plan.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence

from .. import runtime
from . import multinode
from .notebook_values import Guard, Reader, bindings, name_of

KINDS = ("torchrun", "torchrun_nodes", "python", "torch.cuda")
# torch.cuda calls that only ask, and run on a machine without a GPU too.
CUDA_QUERIES = frozenset({"is_available", "device_count"})


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


def _calls(node: ast.AST, guards: tuple[Guard, ...], reader: Reader):
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


def _constant_gpus(call: ast.Call, reader: Reader, where: str) -> int | None:
    node = _keyword(call, "gpus")
    if node is None:
        return None
    values = reader.ints(node)
    if len(values) != 1:
        raise ValueError(f"{where}: cannot read gpus={ast.unparse(node)}; give it a number")
    return values.pop()


def _launch(
    call: ast.Call, guards: tuple[Guard, ...], reader: Reader, notebook: str, cell: int
) -> Launch | None:
    """The :class:`Launch` a call is, or None for any other call.

    Raises:
        ValueError: a launch whose ranks or device cannot be read (the message says where).
    """
    name = name_of(call.func)
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
        return Launch(
            kind="torchrun_nodes",
            nproc=tuple(sorted(totals)),
            device=multinode.SIMULATED_NODES_DEVICE,
            **base,
        )
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
    everywhere = bindings(trees.values())
    found = []
    for i, tree in trees.items():
        reader = Reader(everywhere, bindings([tree]))
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
    return [
        launch
        for path in sorted(folder.glob("[0-9][0-9]_*.ipynb"))
        for launch in notebook_launches(path)
    ]


def cuda_notebooks(launches: Sequence[Launch], gpus: int) -> list[str]:
    """The notebooks with a CUDA path on a machine with ``gpus`` GPUs: at least one launch
    that runs there on ``cuda``; sorted by name."""
    return sorted({x.notebook for x in launches if "cuda" in x.device_types(gpus)})


def nccl_notebooks(launches: Sequence[Launch], gpus: int) -> list[str]:
    """The notebooks that start a job of 2 or more ranks on ``cuda`` (an nccl group that
    talks between GPUs) on a machine with ``gpus`` GPUs; sorted by name."""
    return sorted(
        {
            x.notebook
            for x in launches
            if x.kind != "torch.cuda" and not x.fails_on_purpose(gpus)
            for n in x.ranks(gpus)
            if n >= 2 and x.device_type(n, gpus) == "cuda"
        }
    )
