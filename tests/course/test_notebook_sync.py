"""Notebooks write the committed scripts (stored outputs: tests/course/test_notebook_hygiene.py)."""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _code_cells(path):
    cells = json.loads(path.read_text())["cells"]
    return [c for c in cells if c["cell_type"] == "code"]


def _writefile_cells(path):
    for cell in _code_cells(path):
        source = "".join(cell["source"])
        first, _, body = source.partition("\n")
        if first.startswith("%%writefile"):
            yield first.split()[-1], body


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_writefile_cells_equal_committed_scripts(notebook):
    for target, body in _writefile_cells(notebook):
        path = (notebook.parent / target).resolve()
        assert path.is_relative_to(ROOT / "scripts"), f"{target}: write scripts to ../scripts/"
        assert path.exists(), f"{notebook.name} writes {target}, which is not committed"
        assert path.read_text().rstrip("\n") == body.rstrip("\n"), (
            f"{target} differs from its %%writefile cell in {notebook.name}"
        )


def test_every_script_is_written_by_a_notebook():
    written = {
        (nb.parent / target).resolve() for nb in NOTEBOOKS for target, _ in _writefile_cells(nb)
    }
    scripts = set((ROOT / "scripts").glob("*.py"))
    assert scripts - written == set(), "scripts that no notebook writes"
