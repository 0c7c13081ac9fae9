"""ruff format and ruff check pass on the whole tree (pyproject.toml's settings)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(root, command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_formatter_escapes(root):
    # One way to format (CONTRIBUTING.md): the formatter runs or the folder is excluded.
    marker = "# fmt" + ": skip"
    found = [
        str(path.relative_to(root))
        for folder in ("ddp_course", "scripts", "tests", "notebooks", "docs")
        for path in sorted((root / folder).rglob("*"))
        if path.suffix in (".py", ".ipynb") and marker in _sources(path)
    ]
    assert not found, f"{marker} in {found}"


def _sources(path):
    if path.suffix == ".py":
        return path.read_text()
    # A notebook's cells, not its outputs (which show code as it was when it ran).
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(cell["source"]) for cell in cells)
