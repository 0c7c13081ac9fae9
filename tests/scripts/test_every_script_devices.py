"""Every script that enters ``runtime.distributed()`` places its models and batches on ctx.device.

With two or more GPUs the job runs with nccl, and nccl only takes CUDA tensors:
a model or a batch left on the CPU fails there (or, with gloo, silently runs on
the CPU while the lesson says GPU). No CUDA path runs on a CPU-only machine, so
this is a static check of the source (``ast``), with these definitions:

- **enters distributed**: the script calls ``distributed(...)`` or
  ``<anything>.distributed(...)`` (``runtime.distributed``).
- **model construction**: a call of a class that subclasses ``nn.Module`` and is
  (a) an attribute of ``torch.nn`` written ``nn.X(...)`` / ``torch.nn.X(...)``,
  (b) imported by name from a ``ddp_course`` module (``from ddp_course.models
  import MLP``), or (c) defined in the script with such a class among its
  bases; or a call of a function imported from ``ddp_course`` whose return
  annotation names ``Module`` (``resnet18_mnist``). Wrappers, classes whose
  constructor's first parameter is ``module`` or ``model`` (``DataParallel``,
  ``DistributedDataParallel``, ``BucketedDDP``), move nothing themselves and
  are not constructions. Calls inside the body of a script's own ``nn.Module``
  subclass are sub-modules: they move with their parent and are not checked.
- **batch source**: a call of ``torch.randn``, ``torch.rand`` or
  ``torch.randint`` (the random inputs of the scripts), of ``DataLoader``, or of
  a name imported from ``ddp_course.data`` (``load_mnist``), outside the body of
  a script's own ``nn.Module`` subclass.
- **device expression** ``D``: an expression that contains an attribute
  ``.device`` (``ctx.device``, ``x.device``) or a name ``device``, ``dev`` or
  ending in ``_device``; ``.to("cpu")`` is not a move.
- a construction or a batch source is **placed** when
  (1) its value reaches ``.to(D)`` (or ``.to_empty(device=D)``, for a model built on
  ``meta``): directly (``LayerStack(...).to(ctx.device)``),
  through attributes, indexing and method calls (``images[idx].to(D)``,
  ``torch.randint(...).float().to(D)``), arithmetic, tuples and lists;
  (2) it has a keyword ``device=D``;
  (3) it is inside the arguments of another construction, or in a list of
  layers unpacked into one (``nn.Sequential(*layers)``): it moves with it;
  (4) it is assigned to a name (``x, y = A, B`` pairs ``A`` with ``x``) or is
  the target of a ``for`` over it, and some later use of that name in the same
  function is placed by these rules;
  (5) it is returned by a script function, and every call of that function is
  placed;
  (6) it is passed to a script function whose parameter is placed there.
  A model also passes through a wrapper call (``DDP(model)``; a class or
  function whose first parameter is ``module`` or ``model``), a batch through
  ``DataLoader``, ``Subset``, ``iter``, ``zip``, ``lm_batch``... and a batch is placed when it
  is passed to a ``ddp_course.training`` function that takes ``ctx`` (it moves
  every batch to ``ctx.device``).

Limits, on purpose: the check asks that some use of a value reach the device,
not every use (a batch used once on the device and once on the CPU passes), and
``x, y = f()`` binds both names to one value. It catches a script that never
moves a model or a batch, the bug nccl turns into an error; the multi-GPU runs
check the rest.

A script that enters ``distributed()`` and builds nothing must be listed in
``BUILDS_NOTHING`` with the reason; the test checks that it really builds nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import subprocess

import pytest
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))

# Scripts that enter distributed() but build no model and read no batch: the
# check has nothing to look at, so each one says why that is right.
BUILDS_NOTHING: dict[str, str] = {
    # Prints rank, world size and device: the lesson is the launch itself.
    "00_hello_ranks.py": "prints who it is; no model, no batch",
    # Fails on purpose on one rank to show how the launcher reports it.
    "00_fail_on_rank.py": "raises on one rank; no model, no batch",
    # Lesson 13's runs live in the package; each function there takes ctx.device (or
    # ctx) and moves what it builds to it (ddp_course.mesh_runs, parallel_gpt_runs).
    "13_gpt.py": "passes ctx to ddp_course.mesh_runs and tools.mesh_suite, which build",
    "13_tp_from_scratch.py": "passes ctx to ddp_course.parallel_gpt_runs, which builds",
}

# Scripts the check flags today, with the reason they are expected to fail
# until their fix lands (none now: every script places its work).
KNOWN_UNPLACED: dict[str, str] = {}

RANDOM_FACTORIES = {"randn", "rand", "randint"}
# Calls whose result still holds the batches passed to them (lm_batch: windows of the
# tokens it is given).
CARRIERS = {"DataLoader", "Subset", "TensorDataset", "iter", "next", "enumerate", "zip", "lm_batch"}
WRAPPER_FIRST_PARAMS = {"module", "model"}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One unplaced construction or batch source: ``line`` is 1-based."""

    line: int
    what: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}"


@dataclasses.dataclass
class Report:
    """What :func:`check_source` found in one script."""

    enters_distributed: bool = False
    constructions: int = 0
    batch_sources: int = 0
    unplaced: list[Finding] = dataclasses.field(default_factory=list)

    @property
    def builds_something(self) -> bool:
        return self.constructions + self.batch_sources > 0


def _is_module_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _is_wrapper(obj: object) -> bool:
    """A class (or function) that takes a ready model first: it places nothing itself."""
    try:
        params = list(inspect.signature(obj.__init__ if isinstance(obj, type) else obj).parameters)
    except (TypeError, ValueError):
        return False
    if isinstance(obj, type):
        params = params[1:]  # self
    return bool(params) and params[0] in WRAPPER_FIRST_PARAMS


def _returns_module(fn: object) -> bool:
    if not callable(fn) or isinstance(fn, type):
        return False
    annotation = inspect.signature(fn).return_annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return "Module" in text


def _dotted(node: ast.AST) -> str | None:
    """``nn.Linear`` -> "nn.Linear"; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _is_device_expr(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "device":
            return True
        if isinstance(sub, ast.Name) and (
            sub.id in ("device", "dev") or sub.id.endswith("_device")
        ):
            return True
    return False


def _is_to_device(call: ast.AST) -> bool:
    """``<x>.to(D, ...)``, ``<x>.to(device=D)`` or ``<x>.to_empty(device=D)`` (a model built
    on the ``meta`` device gets its memory there)."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return False
    if call.func.attr not in ("to", "to_empty"):
        return False
    return any(_is_device_expr(a) for a in call.args) or any(
        k.arg == "device" and _is_device_expr(k.value) for k in call.keywords
    )


class _Checker:
    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.imported: dict[str, object] = {}  # local name -> object, ddp_course/torch imports
        self.data_names: set[str] = set()
        self.torch_nn_aliases = {"nn"} if self._imports_nn() else set()
        self._read_imports()
        self.script_modules = self._script_module_classes()

    def _imports_nn(self) -> bool:
        return any(
            isinstance(n, ast.ImportFrom)
            and n.module == "torch"
            and any(a.name == "nn" for a in n.names)
            for n in ast.walk(self.tree)
        )

    def _read_imports(self) -> None:
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if not (node.module.startswith("ddp_course") or node.module.startswith("torch")):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                continue
            for alias in node.names:
                name = alias.asname or alias.name
                if hasattr(module, alias.name):
                    self.imported[name] = getattr(module, alias.name)
                else:  # a submodule: from ddp_course import tensor_parallel as tp
                    try:
                        self.imported[name] = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        continue
                if node.module == "ddp_course.data":
                    self.data_names.add(name)

    def resolve(self, dotted: str) -> object:
        """The object an imported name (``MLP``, ``tp.ParallelFeedForward``) stands for, or None."""
        head, *rest = dotted.split(".")
        obj = self.imported.get(head)
        for attr in rest:
            obj = getattr(obj, attr, None)
        return obj

    def _resolve_base(self, node: ast.AST) -> bool:
        dotted = _dotted(node)
        if dotted is None:
            return False
        head, _, rest = dotted.partition(".")
        if head in self.torch_nn_aliases or dotted.startswith("torch.nn."):
            attr = dotted.split(".")[-1]
            return _is_module_class(getattr(nn, attr, None))
        if dotted in self.imported:
            return _is_module_class(self.imported[dotted])
        return False

    def _script_module_classes(self) -> set[str]:
        names: set[str] = set()
        changed = True
        classes = [n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)]
        while changed:  # a class may derive from another class of the script
            changed = False
            for cls in classes:
                if cls.name in names:
                    continue
                if any(
                    self._resolve_base(b) or (isinstance(b, ast.Name) and b.id in names)
                    for b in cls.bases
                ):
                    names.add(cls.name)
                    changed = True
        return names

    def in_module_class(self, node: ast.AST) -> bool:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.ClassDef) and node.name in self.script_modules:
                return True
        return False

    def is_construction(self, call: ast.Call) -> bool:
        dotted = _dotted(call.func)
        if dotted is None:
            return False
        if dotted in self.script_modules:
            return True
        head = dotted.split(".")[0]
        if head in self.torch_nn_aliases or dotted.startswith("torch.nn."):
            if dotted.count(".") != (2 if dotted.startswith("torch.nn.") else 1):
                return False  # nn.functional.x, nn.init.x, nn.utils.x: not classes
            obj = getattr(nn, dotted.split(".")[-1], None)
            stateless_loss = getattr(obj, "__module__", "") == "torch.nn.modules.loss"
            return _is_module_class(obj) and not _is_wrapper(obj) and not stateless_loss
        obj = self.resolve(dotted)
        # Some objects (functools.partial, typing constructs) have __module__ None.
        if obj is None or not (getattr(obj, "__module__", None) or "").startswith("ddp_course"):
            return False
        if _is_module_class(obj):
            return not _is_wrapper(obj)
        return _returns_module(obj) and not _is_wrapper(obj)

    def is_random_factory(self, call: ast.Call) -> bool:
        dotted = _dotted(call.func) or ""
        return dotted in {f"torch.{f}" for f in RANDOM_FACTORIES}

    def is_data_source(self, call: ast.Call) -> bool:
        dotted = _dotted(call.func) or ""
        return dotted in self.data_names or dotted.split(".")[-1] == "DataLoader"

    def enclosing_function(self, node: ast.AST) -> ast.AST:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return node
        return self.tree

    def script_functions(self) -> dict[str, ast.FunctionDef]:
        return {
            n.name: n
            for n in self.tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }

    def _engine_takes_ctx(self, call: ast.Call) -> bool:
        obj = self.resolve(_dotted(call.func) or "")
        if getattr(obj, "__module__", "") != "ddp_course.training" or not callable(obj):
            return False
        return "ctx" in inspect.signature(obj).parameters

    def reaches_device(self, node: ast.AST, seen: set, data: bool) -> bool:
        """Does the value of expression ``node`` reach a ``.to(D)``? (rules 1, 4, 5, 6).

        ``data``: the value is a batch source, which ``CARRIERS`` pass on and
        the engine's functions that take ``ctx`` move.
        """
        while True:
            parent = self.parents.get(node)
            if isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node:
                node = parent  # x.dataset, x[idx], x.tensors: the same data
                continue
            if isinstance(parent, ast.Call) and parent.func is node:
                if _is_to_device(parent):  # (1)
                    return True
                if isinstance(node, ast.Attribute):
                    node = parent  # a method's result: x.float(), x.view(...)
                    continue
                return False
            if isinstance(parent, ast.keyword):
                node, parent = parent, self.parents.get(parent)
            grand = self.parents.get(parent)
            if (  # x, y = A, B: follow A into x only
                isinstance(parent, ast.Tuple)
                and isinstance(grand, ast.Assign)
                and grand.value is parent
                and len(grand.targets) == 1
                and isinstance(grand.targets[0], ast.Tuple)
                and len(grand.targets[0].elts) == len(parent.elts)
            ):
                target = grand.targets[0].elts[parent.elts.index(node)]
                names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                scope = self.enclosing_function(grand)
                return any(self._name_reaches(n, scope, seen, data) for n in names)
            if isinstance(parent, (ast.List, ast.Tuple, ast.Starred, ast.IfExp, ast.BinOp)):
                node = parent
                continue
            if isinstance(parent, ast.Call):  # node is an argument
                if self.is_construction(parent):
                    return False  # a model's argument is not its data
                if data and self._engine_takes_ctx(parent):  # it moves every batch
                    return True
                if self._argument_reaches(parent, node, seen, data):  # (6)
                    return True
                callee = (_dotted(parent.func) or "").split(".")[-1]
                if self._is_wrapper_call(parent) or (data and callee in CARRIERS):
                    node = parent  # DDP(model), DataLoader(data): the result carries it
                    continue
                return False
            if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
                names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                scope = self.enclosing_function(parent)
                return any(self._name_reaches(n, scope, seen, data) for n in names)  # (4)
            if isinstance(parent, (ast.For, ast.comprehension)) and parent.iter is node:
                names = {n.id for n in ast.walk(parent.target) if isinstance(n, ast.Name)}
                scope = self.enclosing_function(parent)
                return any(self._name_reaches(n, scope, seen, data) for n in names)
            if isinstance(parent, ast.Return):  # (5)
                return self._calls_reach(self.enclosing_function(parent), seen, data)
            if isinstance(parent, (ast.ListComp, ast.GeneratorExp)) and parent.elt is node:
                node = parent
                continue
            return False

    def _is_script_call(self, call: ast.Call) -> bool:
        return (_dotted(call.func) or "") in self.script_functions()

    def _name_reaches(self, name: str, scope: ast.AST, seen: set, data: bool) -> bool:
        if (name, id(scope)) in seen:
            return False
        seen.add((name, id(scope)))
        return any(
            isinstance(n, ast.Name)
            and n.id == name
            and isinstance(n.ctx, ast.Load)
            and self.reaches_device(n, seen, data)
            for n in ast.walk(scope)
        )

    def _argument_reaches(self, call: ast.Call, arg: ast.AST, seen: set, data: bool) -> bool:
        """(6): ``arg`` is passed to a script function whose parameter reaches a move."""
        fn = self.script_functions().get(_dotted(call.func) or "")
        if fn is None:
            return False
        params = [a.arg for a in fn.args.args]
        if arg in call.args:
            i = call.args.index(arg)
            param = params[i] if i < len(params) else None
        else:
            param = next((k.arg for k in call.keywords if k is arg or k.value is arg), None)
        return param is not None and self._name_reaches(param, fn, seen, data)

    def _calls_reach(self, fn: ast.AST, seen: set, data: bool) -> bool:
        """(5): ``fn`` is a script function, called, and every call's result reaches a move."""
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in seen:
            return False
        seen.add(fn.name)
        calls = [
            c for c in ast.walk(self.tree) if isinstance(c, ast.Call) and _dotted(c.func) == fn.name
        ]
        return bool(calls) and all(self.placed(c, seen, data) for c in calls)

    def placed(self, call: ast.Call, seen: set | None = None, data: bool = False) -> bool:
        """Rules (1)-(6) of the module docstring for one construction or batch source."""
        seen = set() if seen is None else seen
        if any(k.arg == "device" and _is_device_expr(k.value) for k in call.keywords):  # (2)
            return True
        if self._inside_construction_arguments(call):  # (3) a sub-module of another one
            return True
        parent = self.parents.get(call)
        if (  # (3) layers.append(nn.Linear(...)), then nn.Sequential(*layers)
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Attribute)
            and parent.func.attr in ("append", "extend", "insert")
            and isinstance(parent.func.value, ast.Name)
            and self._list_into_construction(parent.func.value.id, call)
        ):
            return True
        statement = call
        while statement in self.parents and not isinstance(statement, ast.stmt):
            statement = self.parents[statement]
        if isinstance(statement, ast.Assign) and self.is_construction(call):
            names = {
                n.id for t in statement.targets for n in ast.walk(t) if isinstance(n, ast.Name)
            }
            if any(self._list_into_construction(n, call) for n in names):  # (3)
                return True
        return self.reaches_device(call, seen, data)

    def _inside_construction_arguments(self, call: ast.Call) -> bool:
        node = call
        while node in self.parents and not isinstance(node, ast.stmt):
            parent = self.parents[node]
            if isinstance(parent, ast.Call) and node is not parent.func:
                if self.is_construction(parent):
                    return True
            node = parent
        return False

    def _is_wrapper_call(self, call: ast.Call) -> bool:
        """``split_model(model, ...)``, ``DDP(model)``: a call that takes the model first."""
        dotted = _dotted(call.func) or ""
        obj = self.resolve(dotted)
        if obj is not None:
            return _is_wrapper(obj)
        fn = self.script_functions().get(dotted)
        return fn is not None and bool(fn.args.args) and fn.args.args[0].arg in WRAPPER_FIRST_PARAMS

    def _list_into_construction(self, name: str, call: ast.Call) -> bool:
        """``name`` (a list of layers) is unpacked into a construction in the same function."""
        for sub in ast.walk(self.enclosing_function(call)):
            if isinstance(sub, ast.Call) and self.is_construction(sub):
                for arg in sub.args:
                    inner = arg.value if isinstance(arg, ast.Starred) else arg
                    if isinstance(inner, ast.Name) and inner.id == name:
                        return True
        return False

    def run(self) -> Report:
        report = Report()
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            dotted = _dotted(node.func) or ""
            if dotted == "distributed" or dotted.endswith(".distributed"):
                report.enters_distributed = True
            if self.in_module_class(node):
                continue
            if self.is_construction(node):
                what = f"model {dotted}(...)"
            elif self.is_random_factory(node) or self.is_data_source(node):
                what = f"batch {dotted}(...)"
            else:
                continue
            data = what.startswith("batch")
            report.batch_sources += data
            report.constructions += not data
            if not self.placed(node, data=data):
                report.unplaced.append(Finding(node.lineno, what))
        report.unplaced.sort(key=lambda f: f.line)
        return report


def check_source(source: str) -> Report:
    """Static device check of one script's source (definitions in the module docstring)."""
    return _Checker(ast.parse(source)).run()


def _distributed_scripts() -> list[pathlib.Path]:
    return [s for s in SCRIPTS if check_source(s.read_text()).enters_distributed]


def _params() -> list:
    params = []
    for script in _distributed_scripts():
        marks = []
        if script.name in KNOWN_UNPLACED:
            marks.append(pytest.mark.xfail(reason=KNOWN_UNPLACED[script.name], strict=True))
        params.append(pytest.param(script, id=script.name, marks=marks))
    return params


@pytest.mark.parametrize("script", _params())
def test_script_places_models_and_batches_on_ctx_device(script):
    report = check_source(script.read_text())
    if script.name in BUILDS_NOTHING:
        assert not report.builds_something, (
            f"{script.name} is listed as building nothing but builds "
            f"{report.constructions} model(s) and reads {report.batch_sources} batch source(s)"
        )
        return
    assert report.builds_something, (
        f"{script.name} enters distributed() but builds no model and reads no batch: "
        "add it to BUILDS_NOTHING with the reason"
    )
    assert not report.unplaced, f"{script.name}: not moved to ctx.device: " + "; ".join(
        map(str, report.unplaced)
    )


def test_the_allow_lists_name_existing_distributed_scripts():
    names = {s.name for s in _distributed_scripts()}
    assert set(BUILDS_NOTHING) <= names and set(KNOWN_UNPLACED) <= names


# The lesson 07 scripts as they were before models and batches went through
# ctx.device (abridged from the repository's history): nccl got CPU tensors.
# What both versions share: imports and a model class.
HEADER = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_course.data import load_mnist
from ddp_course.models import LayerStack, MLP
from ddp_course.runtime import distributed


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(784, 64)
"""

OLD_STYLE = (
    HEADER
    + """

def batch(ctx, b, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, 784, generator=gen), torch.randint(0, 10, (b,), generator=gen)


def main():
    with distributed() as ctx:
        model = DDP(LayerStack(784, 256, 8), bucket_cap_mb=1)
        net = nn.Sequential(nn.Linear(784, 32), nn.BatchNorm1d(32))
        wrapped = DDP(TwoHeads())
        images, labels = load_mnist(train=True).tensors()
        mlp = DDP(MLP(784, 128, 2))
        mlp(images[:4])
"""
)

FIXED_STYLE = (
    HEADER
    + """

def batch(ctx, b, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, 784, generator=gen), torch.randint(0, 10, (b,), generator=gen)
    return x.to(ctx.device), y.to(ctx.device)


def main():
    with distributed() as ctx:
        model = DDP(LayerStack(784, 256, 8).to(ctx.device), bucket_cap_mb=1)
        net = nn.Sequential(nn.Linear(784, 32), nn.BatchNorm1d(32))
        net = net.to(ctx.device)
        wrapped = DDP(TwoHeads().to(ctx.device))
        images, labels = load_mnist(train=True).tensors()
        mlp = DDP(MLP(784, 128, 2, device=ctx.device))
        mlp(images[:4].to(ctx.device))
"""
)


def test_old_style_source_is_flagged():
    report = check_source(OLD_STYLE)
    assert report.enters_distributed
    flagged = {f.what for f in report.unplaced}
    assert flagged == {
        "model LayerStack(...)",
        "model nn.Sequential(...)",  # its nn.Linear and nn.BatchNorm1d move with it
        "model TwoHeads(...)",  # its nn.Linear inside __init__ is not checked
        "model MLP(...)",
        "batch torch.randn(...)",
        "batch torch.randint(...)",
        "batch load_mnist(...)",
    }, flagged


def test_fixed_style_source_passes():
    report = check_source(FIXED_STYLE)
    assert report.enters_distributed and report.constructions == 6  # 2 inside Sequential
    assert report.unplaced == []


def test_a_cpu_move_is_not_a_device_move():
    report = check_source(FIXED_STYLE.replace("TwoHeads().to(ctx.device)", 'TwoHeads().to("cpu")'))
    assert [f.what for f in report.unplaced] == ["model TwoHeads(...)"]


OLD_07 = {
    # models built and batches drawn, none of them moved
    "07_ddp_from_scratch.py": """
import torch
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed

def make_model(args, seed):
    torch.manual_seed(seed)
    return LayerStack(784, args.hidden, args.layers, num_classes=10)

def global_batches(args, world_size, steps, per_rank):
    gen = torch.Generator().manual_seed(1)
    n = world_size * per_rank
    return [(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))
            for _ in range(steps)]

def main():
    with distributed(group_of_one=True) as ctx:
        pass
""",
    "07_ddp_knobs.py": """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_course.models import LayerStack
from ddp_course.runtime import distributed

def batch(ctx, b, seed):
    gen = torch.Generator().manual_seed(seed * 100 + ctx.rank)
    return torch.randn(b, 784, generator=gen), torch.randint(0, 10, (b,), generator=gen)

def main():
    with distributed(group_of_one=True) as ctx:
        model = DDP(LayerStack(784, 256, 8), bucket_cap_mb=1.0)
""",
    "07_lr_scaling.py": """
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_course.data import load_mnist
from ddp_course.models import MLP
from ddp_course.runtime import distributed

def train(group, images, labels, idx):
    model = DDP(MLP(784, 128, 2), process_group=group)
    model(images[idx])

def main():
    with distributed(group_of_one=True) as ctx:
        images, labels = load_mnist(train=True, source="subset").tensors()
""",
}


@pytest.mark.parametrize("name", sorted(OLD_07))
def test_lesson07_scripts_before_the_fix_are_flagged(name):
    # Abridged copies of lesson 07's scripts before models and batches went to
    # ctx.device, so the check is seen to catch the bug it guards against.
    assert check_source(OLD_07[name]).unplaced, f"old {name} should be flagged"
    fixed = check_source((ROOT / "scripts" / name).read_text())
    assert fixed.builds_something and not fixed.unplaced


# The commit before lesson 07's scripts moved their models and batches.
BEFORE_FIX = "16867aa61cf52e55e4c87df53e0a2b9ba6e38805"
FLAGGED_BEFORE_FIX = {
    "07_ddp_from_scratch.py": {44, 50},
    "07_ddp_knobs.py": {57, 80, 84, 91, 118, 137, 151},
    "07_lr_scaling.py": {53, 75},
}
# The package's modules those scripts imported, by their names today.
RENAMED_SINCE = {  # old name -> new name
    "ddp_course." + "engine": "ddp_course.training",
    "ddp_course." + "parallel": "ddp_course.data_parallel",
}


@pytest.mark.parametrize("name", sorted(FLAGGED_BEFORE_FIX))
def test_lesson07_scripts_in_history_are_flagged(name):
    shown = subprocess.run(
        ["git", "show", f"{BEFORE_FIX}:scripts/{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if shown.returncode != 0:
        pytest.skip(f"git history without {BEFORE_FIX[:7]} (a shallow clone?)")
    source = shown.stdout
    for old, new in RENAMED_SINCE.items():
        source = source.replace(old, new)
    lines = {f.line for f in check_source(source).unplaced}
    assert lines == FLAGGED_BEFORE_FIX[name]
