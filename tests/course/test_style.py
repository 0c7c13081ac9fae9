"""ruff format and ruff check pass on the whole tree (pyproject.toml's settings)."""

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
    # Notebooks are read whole: their outputs show the package's code as it ran.
    marker = "# fmt" + ": skip"
    found = [
        str(path.relative_to(root))
        for folder in ("ddp_course", "scripts", "tests", "notebooks", "docs")
        for path in sorted((root / folder).rglob("*"))
        if path.suffix in (".py", ".ipynb") and marker in path.read_text()
    ]
    assert not found, f"{marker} in {found}"
