"""Read a committed notebook's code cells from tests (run them with patched launchers)."""

import json
import pathlib

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def code_cell(notebook: str, first_line: str) -> str:
    """The source of the one code cell of ``notebooks/<notebook>`` starting with ``first_line``.

    Raises:
        AssertionError: no such cell, or several (the test must name one).
    """
    found = [
        "".join(c["source"])
        for c in json.loads((NOTEBOOKS / notebook).read_text())["cells"]
        if c["cell_type"] == "code" and "".join(c["source"]).startswith(first_line)
    ]
    assert len(found) == 1, f"{notebook}: {len(found)} cells start with {first_line!r}"
    return found[0]
