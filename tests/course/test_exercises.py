"""Every exercise has a worked solution that CI runs, folded so a learner tries first.

The convention (CONTRIBUTING.md): after a notebook's exercises, a ``## Solutions``
heading; each solution opens with a Markdown cell tagged ``solution`` whose text sits in
``<details><summary><b>Solution to exercise N</b></summary> ... </details>`` (folded in
JupyterLab and on the website); its code cells are tagged ``solution`` and ``hide-cell``
(folded on the website) and carry JupyterLab's ``source_hidden`` and ``outputs_hidden``.
nbval runs them with the rest of the notebook.
"""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# Lessons whose exercises do not all have a solution in this form yet (none today; a new
# lesson may start here). The test of a lesson listed here is expected to fail (strict):
# once its solutions are all written, the xfail turns into a failure and it leaves the list.
SOLUTIONS_PENDING: set[str] = set()

SUMMARY = re.compile(r"^<details>\n<summary><b>Solution to exercise (\d+)</b></summary>\n\n")


def cells(path: pathlib.Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def exercise_count(nb: list[dict]) -> int:
    """Numbered items after the last 'Exercises' heading (``## Exercises`` or ``**Exercises**``)."""
    for cell in reversed(nb):
        text = source(cell)
        match = re.search(r"^(?:#+ |\*\*)Exercises\b", text, re.M)
        if cell["cell_type"] == "markdown" and match:
            return len(re.findall(r"^\d+\. ", text[match.start() :], re.M))
    return 0


def solutions(nb: list[dict]) -> list[tuple[int, list[dict]]]:
    """``(exercise number, its cells)`` for every solution after the ``## Solutions`` heading.

    Raises:
        AssertionError: a cell after the heading breaks the convention.
    """
    starts = [i for i, c in enumerate(nb) if source(c).startswith("## Solutions\n")]
    if not starts:
        return []
    assert len(starts) == 1, "one '## Solutions' heading per notebook"
    found: list[tuple[int, list[dict]]] = []
    for cell in nb[starts[0] + 1 :]:
        tags = cell["metadata"].get("tags", [])
        assert "solution" in tags, f"a cell after '## Solutions' is not tagged: {source(cell)[:60]}"
        if cell["cell_type"] == "markdown":
            match = SUMMARY.match(source(cell))
            assert match, f"a solution's text must be folded in <details>: {source(cell)[:60]}"
            assert source(cell).rstrip().endswith("</details>")
            found.append((int(match.group(1)), [cell]))
        else:
            assert found, "a solution's code comes after its folded text"
            assert "hide-cell" in tags, "solution code is folded on the website (hide-cell)"
            hidden = cell["metadata"].get("jupyter", {})
            assert hidden.get("source_hidden") and hidden.get("outputs_hidden"), (
                "solution code is folded in JupyterLab (source_hidden, outputs_hidden)"
            )
            found[-1][1].append(cell)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_solutions_follow_the_convention(path):
    nb = cells(path)
    numbers = [n for n, _ in solutions(nb)]
    assert numbers == sorted(set(numbers)), f"solutions in order, one each: {numbers}"
    assert all(1 <= n <= exercise_count(nb) for n in numbers), numbers
    # Every solution runs something or says why it needs no code.
    for n, group in solutions(nb):
        assert len(group) > 1 or "no code" in source(group[0]), f"exercise {n} has no code"


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            p,
            marks=pytest.mark.xfail(
                p.stem in SOLUTIONS_PENDING,
                strict=True,
                reason="worked solutions still to be written",
            ),
        )
        for p in NOTEBOOKS
    ],
    ids=lambda p: p.stem,
)
def test_every_exercise_has_a_worked_solution(path):
    nb = cells(path)
    count = exercise_count(nb)
    assert count > 0, "every lesson ends with exercises"
    assert [n for n, _ in solutions(nb)] == list(range(1, count + 1))


def test_the_checks_catch_a_broken_solution():
    good = [
        {"cell_type": "markdown", "metadata": {}, "source": ["## Exercises\n\n1. One.\n2. Two.\n"]},
        {"cell_type": "markdown", "metadata": {}, "source": ["## Solutions\n"]},
        {
            "cell_type": "markdown",
            "metadata": {"tags": ["solution"]},
            "source": [
                "<details>\n<summary><b>Solution to exercise 1</b></summary>\n\n",
                "X\n\n</details>\n",
            ],
        },
        {
            "cell_type": "code",
            "metadata": {
                "tags": ["solution", "hide-cell"],
                "jupyter": {"source_hidden": True, "outputs_hidden": True},
            },
            "source": ["1"],
        },
    ]
    assert exercise_count(good) == 2 and [n for n, _ in solutions(good)] == [1]
    unfolded = json.loads(json.dumps(good))
    unfolded[3]["metadata"]["tags"] = ["solution"]
    with pytest.raises(AssertionError, match="hide-cell"):
        solutions(unfolded)
    open_text = json.loads(json.dumps(good))
    open_text[2]["source"] = ["**Solution to exercise 1.** X\n"]
    with pytest.raises(AssertionError, match="folded in <details>"):
        solutions(open_text)
