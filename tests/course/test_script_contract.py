"""Every script keeps the contract CONTRIBUTING.md writes down: one ``main()``, and a
flag that two scripts share means the same thing in both, spelled one way.

The flags are read from each script as it runs: its ``main()`` is called with
``argparse`` recording every ``add_argument`` and stopping at ``parse_args``, so the
test sees the parser the script really builds (also one built by a helper such as
``TrainConfig.parser`` or ``ddp_course.harness.script_args.script_parser``). The contract
itself, each shared flag with its type and the spellings it replaces, is
``script_args.CONTRACT``.
"""

import argparse
import ast
import functools
import importlib.util
import pathlib
import sys
from unittest import mock

import pytest

from ddp_course.harness.script_args import CONTRACT, script_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("[0-9][0-9]_*.py"))

# The shared flags (with the type argparse converts each to: bool, a switch) and the
# spellings the contract has one word for, from the contract's one home.
TYPES = {name: flag.type for name, flag in CONTRACT.items()}
SYNONYMS = {other: name for name, flag in CONTRACT.items() for other in flag.synonyms}


class _Parsed(Exception):
    """Raised in place of ``parse_args``: the parser is complete."""


@functools.cache
def script_flags(path: pathlib.Path) -> dict[str, dict]:
    """``{flag: add_argument's keyword arguments}`` of the parser ``path``'s main() builds."""
    spec = importlib.util.spec_from_file_location(f"contract_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = {}
    real_add = argparse.ArgumentParser.add_argument

    def add(self, *names, **kwargs):
        seen.update({name: kwargs for name in names if name.startswith("--")})
        return real_add(self, *names, **kwargs)

    def parse(self, *args, **kwargs):
        raise _Parsed

    with (
        mock.patch.object(argparse.ArgumentParser, "add_argument", add),
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse),
        mock.patch.object(sys, "argv", [str(path)]),
    ):
        try:
            module.main()
        except _Parsed:
            seen.pop("--help", None)
            return seen
    raise AssertionError(f"{path.name}: main() returned without parsing its arguments")


def _converts_to(kwargs: dict) -> type:
    action = kwargs.get("action")
    if action in ("store_true", "store_false", argparse.BooleanOptionalAction):
        return bool
    return kwargs.get("type", str)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_one_main_called_under_the_main_guard(script):
    tree = ast.parse(script.read_text())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    guards = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
    ]
    assert "main" in functions, f"{script.name}: define main()"
    assert len(guards) == 1 and [ast.unparse(s) for s in guards[0].body] == ["main()"], (
        f'{script.name}: end with `if __name__ == "__main__":\\n    main()`'
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_shared_flags_are_spelled_and_typed_as_the_contract_says(script):
    flags = script_flags(script)
    wrong = {flag: SYNONYMS[flag] for flag in flags if flag in SYNONYMS}
    assert not wrong, f"{script.name}: spell these as the contract does: {wrong}"
    if "--d-model" in flags and "--seq-len" in flags:  # a Transformer's shape
        assert "--layers" not in flags, f"{script.name}: a Transformer's blocks are --n-layers"
    underscores = [flag for flag in flags if "_" in flag]
    assert not underscores, f"{script.name}: flags use hyphens: {underscores}"
    types = {flag: _converts_to(flags[flag]) for flag in flags if flag in TYPES}
    off = {flag: kind.__name__ for flag, kind in types.items() if kind is not TYPES[flag]}
    assert not off, f"{script.name}: these flags convert to the wrong type: {off}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_script_with_a_progress_bar_turns_it_off_with_no_progress(script):
    flags = script_flags(script)
    if "--progress" in flags or "--no-progress" in flags:
        no_progress = flags.get("--no-progress") or flags["--progress"]
        assert no_progress.get("action") in ("store_true", argparse.BooleanOptionalAction)


def test_the_contract_test_sees_a_wrong_spelling(tmp_path):
    script = tmp_path / "99_wrong.py"
    script.write_text(
        "import argparse\n\ndef main():\n    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--heads', type=int)\n    p.add_argument('--lr', type=int)\n"
        "    p.parse_args()\n\nif __name__ == '__main__':\n    main()\n"
    )
    flags = script_flags(script)
    assert set(flags) == {"--heads", "--lr"}
    with pytest.raises(AssertionError, match="--n-heads"):
        test_shared_flags_are_spelled_and_typed_as_the_contract_says(script)
    typed = tmp_path / "99_typed.py"  # another path: script_flags caches by path
    typed.write_text(script.read_text().replace("'--heads'", "'--n-heads'"))
    with pytest.raises(AssertionError, match="wrong type.*--lr"):
        test_shared_flags_are_spelled_and_typed_as_the_contract_says(typed)


def test_script_parser_adds_the_contract_flags_it_names_at_the_scripts_defaults():
    parser = script_parser(
        "One line.\n\nMore.",
        steps=3,
        results=None,
        no_progress=False,
        help={"steps": "SGD steps per case"},
    )
    assert parser.description == "One line."
    assert vars(parser.parse_args([])) == {"steps": 3, "results": None, "no_progress": False}
    args = parser.parse_args(["--steps", "5", "--no-progress", "--results", "r.json"])
    assert vars(args) == {"steps": 5, "results": "r.json", "no_progress": True}
    usage = parser.format_help()
    assert "SGD steps per case" in usage and CONTRACT["--results"].help in usage
    assert "--steps STEPS" in usage and "--results PATH" in usage  # the unit names the value
    for wrong in ({"batch": 4}, {"no_progress": True}, {"help": {"lr": "a rate"}}):
        with pytest.raises(TypeError):
            script_parser("x", **wrong)


def test_the_contract_test_sees_the_flags_script_parser_adds(tmp_path):
    script = tmp_path / "99_built.py"
    script.write_text(
        "from ddp_course.harness.script_args import script_parser\n\ndef main():\n"
        "    p = script_parser('built', steps=2, lr=0.1)\n"
        "    p.add_argument('--iters', type=int)\n    p.parse_args()\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    assert set(script_flags(script)) == {"--steps", "--lr", "--iters"}
    with pytest.raises(AssertionError, match="--iters"):
        test_shared_flags_are_spelled_and_typed_as_the_contract_says(script)
