"""The graphs ``torch.compile`` builds, counted, and the recompilations it logs.

Dynamo hands every graph it captures to a *backend*: a callable
``backend(gm: torch.fx.GraphModule, example_inputs) -> callable``
(https://pytorch.org/docs/stable/torch.compiler_custom_backends.html).
:class:`GraphCounter` is such a backend: it keeps each graph and passes it on to
a real one (``"aot_eager"``: AOTAutograd's forward and backward graphs, run by
eager kernels, so the numbers equal eager's; ``"inductor"``: generated code).
Counting graphs this way needs no log parsing and sees the graphs that the
DDP optimizer splits off (one per bucket) as Dynamo hands them on.

:func:`recompile_reasons` collects the guard failures behind each recompilation
from the ``recompiles`` log (``torch._logging.set_logs(recompiles=True)``,
https://pytorch.org/docs/stable/logging.html), as text.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator

import torch
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.backends.registry import lookup_backend

__all__ = ["GraphCounter", "recompile_reasons", "COLLECTIVE_TARGETS"]

# The operators a graph calls to communicate: the functional collectives, which DTensor,
# compiled autograd's DDP reducer and traced gradient hooks put in a graph.
COLLECTIVE_TARGETS = ("_c10d_functional.", "c10d.")
# Where torch/_dynamo/guards.py logs its recompiles artifact.
RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
_LEVELS_KEPT = ("torch", "torch._dynamo", "torch._inductor")


class GraphCounter:
    """A ``torch.compile`` backend that keeps every graph it is handed.

    Pass the instance as ``torch.compile(model, backend=counter)``. Each call
    appends Dynamo's ``torch.fx.GraphModule`` to :attr:`graphs` and compiles it
    with ``inner`` (the name of a registered backend). Under ``"aot_eager"`` it
    also keeps the forward and backward graphs AOTAutograd derives from it
    (:attr:`aot`): there DTensor's and compiled autograd's collectives are
    operators (``_c10d_functional.all_reduce.default``). Dynamo reuses a graph
    for every call its guards accept, so :attr:`runs` counts the calls.

    Args:
        inner: ``"aot_eager"`` (default) or ``"inductor"``, or any name
            ``torch._dynamo.list_backends()`` gives.

    Attributes:
        graphs: Dynamo's graphs, in the order it handed them over.
        runs: per graph, how many times its compiled code ran.
        aot: ``("forward" | "backward", graph)`` pairs, under ``"aot_eager"`` only.
    """

    def __init__(self, inner: str = "aot_eager"):
        self.inner = inner
        self.graphs: list[torch.fx.GraphModule] = []
        self.runs: list[int] = []
        self.aot: list[tuple[str, torch.fx.GraphModule]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        compile_fn = lookup_backend(self.inner)
        if self.inner == "aot_eager":
            compiled = compile_fn(
                gm,
                example_inputs,
                fw_compiler=self._keep("forward"),
                bw_compiler=self._keep("backward"),
            )
        else:
            compiled = compile_fn(gm, example_inputs)
        index = len(self.runs)
        self.runs.append(0)

        @functools.wraps(compiled)
        def run(*args, **kwargs):
            self.runs[index] += 1
            return compiled(*args, **kwargs)

        return run

    def _keep(self, kind: str):
        def keep(gm, example_inputs):
            self.aot.append((kind, gm))
            return boxed_nop(gm, example_inputs)

        return keep

    def aot_collectives(self) -> dict[str, dict[str, int]]:
        """Collective operators in AOTAutograd's graphs, counted by name, for
        ``"forward"`` and ``"backward"`` (empty unless ``inner="aot_eager"``)."""
        out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        for kind, gm in self.aot:
            for name in _collective_names(gm):
                out[kind][name] = out[kind].get(name, 0) + 1
        return out

    def collectives(self) -> list[list[str]]:
        """Per graph, the names of the collective operators it calls
        (``_c10d_functional.all_reduce.default`` ...): communication traced into
        the graph, as opposed to a collective run eagerly between graphs."""
        return [_collective_names(g) for g in self.graphs]

    def parameter_bytes(self) -> list[int]:
        """Per graph, the bytes of the parameters it reads, each counted once.

        Dynamo lifts a module's parameters to the graph's inputs and names each
        placeholder after its source (``l_self_modules_net_modules_1_parameters_weight_``);
        the DDP optimizer cuts the graph where its buckets of parameters end, so
        these are the bucket sizes as the graphs see them.
        """
        sizes = []
        for g in self.graphs:
            sizes.append(
                sum(
                    n.meta["example_value"].numel() * n.meta["example_value"].element_size()
                    for n in g.graph.nodes
                    if n.op == "placeholder" and "_parameters_" in n.name
                )
            )
        return sizes


def _collective_names(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if str(n.target).startswith(COLLECTIVE_TARGETS)]


class _Collect(logging.Handler):
    def __init__(self, into: list[str]):
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(_without_folders(record.getMessage()))


@contextlib.contextmanager
def recompile_reasons() -> Iterator[list[str]]:
    """Collect the ``recompiles`` log (why a frame was compiled again) as text.

    Yields a list that fills with one message per recompilation, each naming
    the function (its file without folders) and the guard that failed
    (``tensor 'x' size mismatch at index 0. expected 8, actual 6``). The log is
    switched on with ``torch._logging.set_logs(recompiles=True)`` inside the
    block and off after (``set_logs`` resets every log setting; the levels of the
    ``torch`` loggers set before are put back); its lines go to the list, not to
    stderr.
    """
    levels = {name: logging.getLogger(name).level for name in _LEVELS_KEPT}
    messages: list[str] = []
    handler = _Collect(messages)
    logger = logging.getLogger(RECOMPILES_LOGGER)
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        torch._logging.set_logs()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _without_folders(text: str) -> str:
    """``/any/folder/file.py`` becomes ``file.py``: the log names files by absolute path."""
    return re.sub(r"/(?:[^/\s\"']+/)+([^/\s\"']+)", r"\1", text)
