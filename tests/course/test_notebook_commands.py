"""Shell commands the lessons tell a learner to type work as written.

Every ```bash block in a notebook's Markdown runs from the repository root (where the
terminal of `make lab` opens) with this environment's bin folder (.venv/bin) first on
PATH, and must exit 0 within the timeout. Lines not meant to run as they are (several
machines, placeholders, `make lab`) belong in ```text blocks, which are not run.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
BIN = pathlib.Path(sys.executable).parent  # .venv/bin; not resolved (a link to the base)
TIMEOUT_S = 120  # blocks are meant to take under 60 s; the margin is for a busy machine
FENCE = re.compile(r"^(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
SHELL_LIKE = {"sh", "shell", "console", "zsh", "shell-session"}


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block of a Markdown text."""
    return [(m.group(2).lower(), m.group(3)) for m in FENCE.finditer(markdown)]


def notebook_blocks(path: pathlib.Path) -> list[tuple[str, str]]:
    cells = json.loads(path.read_text())["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    return [block for text in markdown for block in fenced_blocks(text)]


def _bash_blocks():
    for path in NOTEBOOKS:
        bash = [body for lang, body in notebook_blocks(path) if lang == "bash"]
        for index, body in enumerate(bash):
            yield pytest.param(body, id=f"{path.stem}-{index}")


def run_block(body: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a block with bash -e from the repository root, BIN first on PATH."""
    env = dict(os.environ, PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", body],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


# Plain torchrun, as a learner types it, serves its store on every interface (lesson 03
# shows it); the course's launcher is what binds it to loopback.
@pytest.mark.listens_everywhere("plain torchrun's store, as lesson 03 shows")
@pytest.mark.parametrize("body", list(_bash_blocks()))
def test_bash_block_runs_as_written_from_the_repository_root(body):
    done = run_block(body)
    assert done.returncode == 0, f"$ {body}\nexit {done.returncode}\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_shell_blocks_say_bash_or_text(notebook):
    # Any other label would escape the test above without being marked as not runnable.
    labels = [lang for lang, _ in notebook_blocks(notebook) if lang in SHELL_LIKE]
    assert labels == [], "label shell blocks ```bash (run by the tests) or ```text (not run)"


def test_blocks_are_found_and_a_failing_command_fails():
    markdown = (
        "Type:\n\n```bash\ntorchrun --version\n```\n\nnot this:\n\n```text\nmake lab\n```\n"
        "and\n\n~~~bash\ncd notebooks\n~~~\n"
    )
    assert fenced_blocks(markdown) == [
        ("bash", "torchrun --version\n"),
        ("text", "make lab\n"),
        ("bash", "cd notebooks\n"),
    ]
    # The environment's torchrun is found, from the root; failures and wrong paths show.
    assert run_block("torchrun --help >/dev/null && test -d scripts").returncode == 0
    assert run_block("false\necho reached").returncode != 0
    assert run_block("python scripts/no_such_script.py").returncode != 0
