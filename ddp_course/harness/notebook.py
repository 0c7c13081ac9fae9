"""What every lesson's cells use to show things: a table of rows, and the source of a
mechanism the lesson teaches.

Both render in JupyterLab, in nbval's stored outputs and on the website alike: a
table is Markdown (``IPython.display.Markdown``), source is plain text.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable, Sequence

from IPython.display import Markdown, display

__all__ = ["markdown_table", "show_source", "table"]


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """``rows`` under ``header`` as a Markdown table (each cell through ``str``).

    Raises:
        ValueError: if a row has more or fewer cells than the header (a table
            that would render shifted columns).
    """
    header = [str(h) for h in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"a row has {len(cells)} cells, the header {len(header)}: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> None:
    """Display ``rows`` under ``header`` as a Markdown table (see :func:`markdown_table`)."""
    display(Markdown(markdown_table(header, rows)))


def show_source(*objects: object, docstrings: bool = True) -> None:
    """Print the source code of each function, class or method, one after the other.

    Args:
        objects: what to show.
        docstrings: ``False`` cuts each function's docstring out, so the code the
            lesson is about fills the cell.

    Raises:
        TypeError: for an object without Python source (a builtin, a C function).
    """
    for i, obj in enumerate(objects):
        source = inspect.getsource(obj)
        if not docstrings:
            source = _without_docstring(source)
        print(("\n" if i else "") + source, end="")


def _without_docstring(source: str) -> str:
    # The first statement of the function's body, when it is a string, is its docstring.
    body = ast.parse(textwrap.dedent(source)).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        lines = source.splitlines(keepends=True)
        source = "".join(lines[: body[0].lineno - 1] + lines[body[0].end_lineno :])
    return source
