"""Stored notebooks read cleanly for a learner and stay clean when opened.

Over every committed notebook: no absolute paths of the machine that ran it, progress
bars that end at 100%, no argparse usage blocks, no error outputs, no internal project
vocabulary, no stored widget models that no output shows (left from an earlier run),
execution counts 1..n from one clean run, and the kernel metadata JupyterLab
writes (another value marks the notebook modified as soon as it is opened). Re-execute
with `python -m ddp_course execute notebooks/NN_x.ipynb` to fix most of them.
"""

import copy
import json
import pathlib
import re

import nbformat
import pytest

from ddp_course.harness.cli import KERNELSPEC

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# A path of this or another machine: /work/..., /tmp/..., C:\..., not a URL's path.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])(/(?:work|tmp|home|root|Users)(?=[/\s'\"]|$)|[A-Z]:\\)")
# tqdm's text: "desc:  97%|█████████▋| 61/63 [...]"
TQDM = re.compile(r"(\d{1,3})%\|[^|]*\|\s*(\d+)/(\d+)")
USAGE = re.compile(r"^usage: ", re.M)
# The launcher's "still running" lines are for a person waiting; `execute` turns them off.
HEARTBEAT = re.compile(r"^\s*\.\.\. \S+ still running, \d+ s$", re.M)
INTERNAL = re.compile(
    r"pitfall\s*\d+|performance goal|seed material|source article|work order|issue\s*#",
    re.I,
)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _output_texts(output: dict) -> list[str]:
    if output["output_type"] == "stream":
        return [_text(output["text"])]
    if output["output_type"] == "error":
        return ["\n".join(output.get("traceback", []))]
    return [_text(v) for k, v in output.get("data", {}).items() if k.startswith("text/")]


def _stuck_text_bars(text: str) -> list[str]:
    """tqdm text bars whose last state (after the last carriage return) is below 100%."""
    stuck = []
    for line in text.split("\n"):
        last = line.split("\r")[-1] if line.split("\r")[-1].strip() else line.rstrip("\r")
        last = last.split("\r")[-1]
        match = TQDM.search(last)
        if match and (int(match.group(1)) < 100 or match.group(2) != match.group(3)):
            stuck.append(last.strip())
    return stuck


def _stuck_widget_bars(output: dict, states: dict) -> list[str]:
    """tqdm widget bars (HBox of label, progress, counter) not shown complete."""
    model_id = output["data"][WIDGET_VIEW]["model_id"]
    box = states.get(model_id)
    if box is None:  # no stored state: readers see the text form, frozen at its start
        return _stuck_text_bars(_text(output["data"].get("text/plain", "")))
    parts = [states.get(c.removeprefix("IPY_MODEL_"), {}) for c in box["state"].get("children", [])]
    text = " ".join(str(p.get("state", {}).get("value", "")) for p in parts)
    text = text.replace("\u2007", " ").replace("&lt;", "<")
    bars = [p["state"] for p in parts if p.get("model_name") == "FloatProgressModel"]
    incomplete = any(b.get("value") is None or b["value"] < (b.get("max") or 0) for b in bars)
    percent = re.search(r"(\d{1,3})%", text)
    counts = re.search(r"(\d+)/(\d+)", text)
    if (
        incomplete
        or (percent and int(percent.group(1)) < 100)
        or (counts and counts.group(1) != counts.group(2))
    ):
        return [text.strip()]
    return []


def _model_refs(value) -> list[str]:
    """The widget models a widget's state refers to ("IPY_MODEL_<id>": children, layout...)."""
    if isinstance(value, str):
        return [value.removeprefix("IPY_MODEL_")] if value.startswith("IPY_MODEL_") else []
    if isinstance(value, dict):
        return [ref for v in value.values() for ref in _model_refs(v)]
    if isinstance(value, list):
        return [ref for v in value for ref in _model_refs(v)]
    return []


def _orphaned_widgets(nb: dict, states: dict) -> set[str]:
    """Stored widget models that no output shows, directly or as a part of one."""
    stack = [
        out["data"][WIDGET_VIEW]["model_id"]
        for cell in nb["cells"]
        for out in cell.get("outputs", [])
        if WIDGET_VIEW in out.get("data", {})
    ]
    shown: set[str] = set()
    while stack:
        model = stack.pop()
        if model in states and model not in shown:
            shown.add(model)
            stack += _model_refs(states[model])
    return set(states) - shown


def problems(nb: dict) -> list[str]:
    """Every hygiene problem of a notebook (its JSON), as readable lines."""
    found = []
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(code) + 1)):
        found.append(f"execution counts {counts} are not 1..{len(code)}: re-run top to bottom")
    spec = nb.get("metadata", {}).get("kernelspec")
    if spec != KERNELSPEC:
        found.append(f"kernelspec {spec} is not JupyterLab's {KERNELSPEC}")
    language = nb.get("metadata", {}).get("language_info", {}).get("name")
    if language != "python":
        found.append(f"language_info.name is {language!r}, not the kernel's 'python'")
    states = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    orphans = _orphaned_widgets(nb, states)
    if orphans:
        found.append(
            f"{len(orphans)} stored widget model(s) that no output shows: "
            "remove metadata.widgets and re-run"
        )
    for index, cell in enumerate(nb["cells"]):
        where = f"cell {index}"
        source = _text(cell["source"])
        for match in INTERNAL.finditer(source):
            found.append(f"{where}: internal vocabulary {match.group(0)!r}")
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                found.append(f"{where}: error output {output.get('ename')}")
            for text in _output_texts(output):
                for match in MACHINE_PATH.finditer(text):
                    line = text[max(0, match.start() - 40) : match.end() + 40].replace("\n", " ")
                    found.append(f"{where}: machine path {match.group(0)!r} in ...{line}...")
                if USAGE.search(text):
                    found.append(f"{where}: an argparse usage block in the output")
                if HEARTBEAT.search(text):
                    found.append(f"{where}: a launcher heartbeat line in the output")
            if WIDGET_VIEW in output.get("data", {}):
                bars = _stuck_widget_bars(output, states)
            else:
                bars = [b for t in _output_texts(output) for b in _stuck_text_bars(t)]
            found += [f"{where}: progress bar stored below 100%: {bar!r}" for bar in bars]
    return found


def saving_changes_it(text: str) -> bool:
    """Whether Jupyter, saving the notebook unchanged, would write other bytes.

    Jupyter's server saves with ``nbformat.write`` (sorted keys, one-space indent,
    cell ids, a final newline); committed files written otherwise change on save.
    """
    return nbformat.writes(nbformat.reads(text, as_version=4)) + "\n" != text


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean(notebook):
    text = notebook.read_text()
    found = problems(json.loads(text))
    if saving_changes_it(text):
        found.append("saving it unchanged rewrites the file: store it with nbformat.write")
    assert found == [], "\n".join(found)


# The checks themselves: a clean fake notebook passes; each defect is caught.


def _clean() -> dict:
    def code(n, outputs):
        return {
            "cell_type": "code",
            "execution_count": n,
            "metadata": {},
            "source": "x = 1",
            "outputs": outputs,
        }

    done = "epoch 1: 100%|██████████| 63/63 [00:02<00:00, 25.35it/s]\n"
    return {
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "# Title\nSee the ring below."},
            code(1, [{"output_type": "stream", "name": "stdout", "text": "wrote build/x.json\n"}]),
            code(
                2, [{"output_type": "stream", "name": "stderr", "text": "  0%|  | 0/63\r" + done}]
            ),
            code(
                3,
                [
                    {
                        "output_type": "display_data",
                        "metadata": {},
                        "data": {"text/plain": "see https://pytorch.org/home/docs/"},
                    }
                ],
            ),
        ],
        "metadata": {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _widget_notebook(value: float, label: str) -> dict:
    nb = _clean()
    states = {
        "box": {
            "model_name": "HBoxModel",
            "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_c"]},
        },
        "l": {"model_name": "HTMLModel", "state": {"value": label}},
        "p": {"model_name": "FloatProgressModel", "state": {"value": value, "max": 63.0}},
        "c": {"model_name": "HTMLModel", "state": {"value": f"{int(value)}/63"}},
    }
    nb["metadata"]["widgets"] = {WIDGET_STATE: {"state": states}}
    nb["cells"][3]["outputs"] = [
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {WIDGET_VIEW: {"model_id": "box"}, "text/plain": "  0%|  | 0/63"},
        }
    ]
    return nb


def test_a_clean_notebook_passes():
    assert problems(_clean()) == []
    assert problems(_widget_notebook(63.0, "epoch\u20071: 100%")) == []


def _with(change) -> dict:
    nb = copy.deepcopy(_clean())
    change(nb)
    return nb


def _set_output(cell: int, text: str, name: str = "stdout"):
    def change(nb):
        nb["cells"][cell]["outputs"] = [{"output_type": "stream", "name": name, "text": text}]

    return change


@pytest.mark.parametrize(
    "change, expected",
    [
        (_set_output(1, "saved to /work/main/build/x.json\n"), "machine path '/work'"),
        (_set_output(1, "cwd is /tmp\n"), "machine path '/tmp'"),
        (_set_output(1, 'File "/home/ana/x.py", line 3\n'), "machine path '/home'"),
        (_set_output(1, "in /root/.cache\n"), "machine path '/root'"),
        (_set_output(1, "at /Users/ana/ddp\n"), "machine path '/Users'"),
        (_set_output(1, "at C:\\Users\\ana\n"), "machine path 'C:\\\\'"),
        (
            _set_output(2, "  0%|  | 0/63\r 97%|█████████▋| 61/63 [00:03<00:00]\n", "stderr"),
            "progress bar stored below 100%",
        ),
        (
            _set_output(2, "usage: 05_train_ddp.py [-h] [--epochs N]\nerror: bad\n", "stderr"),
            "argparse usage block",
        ),
        (
            _set_output(2, "$ torchrun x.py\n  ... x.py still running, 10 s\nx.py done\n"),
            "heartbeat line",
        ),
        (
            lambda nb: nb["cells"][1]["outputs"].append(
                {"output_type": "error", "ename": "ValueError", "evalue": "", "traceback": []}
            ),
            "error output ValueError",
        ),
        (lambda nb: nb["cells"][0].update(source="As pitfall 8 says"), "internal vocabulary"),
        (lambda nb: nb["cells"][0].update(source="the performance goal"), "internal vocabulary"),
        (lambda nb: nb["cells"][0].update(source="from the seed material"), "internal vocabulary"),
        (lambda nb: nb["cells"][0].update(source="the Source articles"), "internal vocabulary"),
        (lambda nb: nb["cells"][0].update(source="this work order"), "internal vocabulary"),
        (lambda nb: nb["cells"][0].update(source="fixes issue #7"), "internal vocabulary"),
        (lambda nb: nb["cells"][2].update(execution_count=5), "execution counts"),
        (lambda nb: nb["cells"][3].update(execution_count=None), "execution counts"),
        (lambda nb: nb["metadata"]["kernelspec"].update(display_name="Python 3"), "kernelspec"),
        (lambda nb: nb["metadata"].pop("language_info"), "language_info"),
    ],
)
def test_each_defect_is_caught(change, expected):
    found = problems(_with(change))
    assert any(expected in line for line in found), found


def test_a_notebook_written_otherwise_than_jupyter_writes_is_caught():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title")])
    assert not saving_changes_it(nbformat.writes(nb) + "\n")
    assert saving_changes_it(json.dumps(nb, indent=2) + "\n")
    assert saving_changes_it(nbformat.writes(nb))  # no final newline


def test_widget_bars_stored_below_100_percent_are_caught():
    # The bar's value reached its end but its label was last drawn at 97%.
    assert problems(_widget_notebook(63.0, "epoch\u20070:\u2007\u200797%"))
    assert problems(_widget_notebook(40.0, "epoch\u20070:\u2007\u200763%"))
    no_state = _widget_notebook(63.0, "epoch 0: 100%")
    no_state["metadata"].pop("widgets")  # readers then see the text form, at 0%
    assert problems(no_state)


def test_widget_models_no_output_shows_are_caught():
    orphaned = _widget_notebook(63.0, "epoch\u20071: 100%")
    orphaned["cells"][3]["outputs"] = []  # the bar's output is gone, its models stayed
    assert any("4 stored widget model(s)" in line for line in problems(orphaned))
    extra = _widget_notebook(63.0, "epoch\u20071: 100%")
    extra["metadata"]["widgets"][WIDGET_STATE]["state"]["old"] = {"model_name": "HTMLModel"}
    assert any("1 stored widget model(s)" in line for line in problems(extra))
