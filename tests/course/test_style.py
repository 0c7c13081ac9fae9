"""ruff format and ruff check pass on the whole tree (pyproject.toml's settings)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(root, command):
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=root,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
