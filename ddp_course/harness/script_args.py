"""The script contract: the command-line flags that scripts share, and the parser that
adds them.

A flag two scripts share means the same thing in both and is spelled one way
(CONTRIBUTING.md). :data:`CONTRACT` is that rule's one home: each shared flag with the
type ``argparse`` converts it to, what it means, its unit and the spellings it replaces.
:func:`script_parser` starts a script's parser with the contract's flags it names, at the
script's defaults; the script adds its own flags to the parser it gets back::

    parser = script_parser(__doc__, steps=3, batch_size=32, results=None,
                           help={"steps": "SGD steps per comparison"})
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args()

``tests/course/test_script_contract.py`` reads :data:`CONTRACT` and checks every
script's flags against it, whether a script adds them itself or through this parser.
"""

from __future__ import annotations

import argparse
import dataclasses

__all__ = ["CONTRACT", "Flag", "script_parser"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """One shared flag of the contract.

    Attributes:
        name: the flag as typed, e.g. ``"--batch-size"``; its keyword in
            :func:`script_parser` and its attribute on the parsed namespace are
            ``batch_size``.
        type: what ``argparse`` converts the value to: ``int``, ``float``, ``str``,
            or ``bool`` for a switch that takes no value (``store_true``).
        help: what the flag means in every script, shown by ``--help`` unless the
            script says what it means there more narrowly.
        unit: what the value counts or names (``"samples"``, ``"seconds"``,
            ``"path"``); ``--help`` shows it as the value's name
            (``--timeout-s SECONDS``). Empty for a switch and a pure number.
        synonyms: other spellings of the same flag, which no script may use.
    """

    name: str
    type: type
    help: str
    unit: str = ""
    synonyms: tuple[str, ...] = ()

    @property
    def keyword(self) -> str:
        """The flag's keyword and namespace attribute: ``--batch-size`` -> ``batch_size``."""
        return self.name.removeprefix("--").replace("-", "_")


CONTRACT: dict[str, Flag] = {
    flag.name: flag
    for flag in (
        Flag("--batch-size", int, "samples per rank per step", "samples", ("--batch", "--bs")),
        Flag("--hidden", int, "features of a hidden layer", "features"),
        Flag("--epochs", int, "passes over the training data", "epochs"),
        Flag("--steps", int, "optimizer steps", "steps", ("--num-steps", "--n-steps", "--iters")),
        Flag("--lr", float, "learning rate", synonyms=("--learning-rate",)),
        Flag("--seed", int, "random seed, the same on every rank"),
        Flag("--timeout-s", float, "the process group's timeout", "seconds", ("--timeout",)),
        Flag("--checkpoint", str, "save to this file, resume from it", "path", ("--ckpt",)),
        Flag(
            "--results",
            str,
            "rank 0 writes the results here as JSON",
            "path",
            ("--output", "--out", "--json"),
        ),
        Flag("--no-progress", bool, "no progress bar"),
        # A Transformer's shape: TinyGPT's arguments, spelled as flags.
        Flag(
            "--d-model",
            int,
            "model width: features in and out of a block",
            "features",
            ("--n-embd", "--dim"),
        ),
        Flag("--n-heads", int, "attention heads", "heads", ("--heads", "--num-heads")),
        Flag("--n-layers", int, "Transformer blocks", "blocks", ("--num-layers",)),
        Flag("--seq-len", int, "tokens per sequence", "tokens", ("--block-size", "--seq-length")),
    )
}
"""The shared flags by name (``"--batch-size"``)."""

_BY_KEYWORD = {flag.keyword: flag for flag in CONTRACT.values()}


def script_parser(
    description: str, *, help: dict[str, str] | None = None, **defaults: object
) -> argparse.ArgumentParser:
    """A script's parser holding the contract's flags it names, at its defaults.

    Args:
        description: the script's docstring (or one line); its first line is the
            description ``--help`` shows.
        help: per keyword, what the flag means in this script where that is narrower
            than the contract's words (``{"steps": "SGD steps per comparison"}``).
        defaults: one keyword per contract flag the script takes (:attr:`Flag.keyword`:
            ``batch_size=32`` adds ``--batch-size``), its value the flag's default;
            ``results=None`` adds ``--results`` with no default, and a switch's value
            is ``False`` (``no_progress=False``). Flags are added in the keywords'
            order; the script adds its own after them.

    Returns:
        The ``argparse.ArgumentParser``, for the script to add its own flags and parse.

    Raises:
        TypeError: for a keyword that names no contract flag (in ``defaults`` or
            ``help``), a help text for a flag not added, or a switch whose default is
            not ``False``: the contract would not hold for it.
    """
    help = help or {}
    unknown = sorted((set(defaults) | set(help)) - set(_BY_KEYWORD))
    if unknown:
        raise TypeError(f"not flags of the script contract: {unknown}; it has {list(_BY_KEYWORD)}")
    if set(help) - set(defaults):
        raise TypeError(f"help for flags not added: {sorted(set(help) - set(defaults))}")
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    for keyword, default in defaults.items():
        flag = _BY_KEYWORD[keyword]
        text = help.get(keyword, flag.help)
        if flag.type is bool:
            if default is not False:
                raise TypeError(f"{flag.name} is a switch: its default is False, not {default!r}")
            parser.add_argument(flag.name, action="store_true", help=text)
            continue
        parser.add_argument(
            flag.name,
            type=flag.type,
            default=default,
            metavar=flag.unit.upper() or None,
            help=text,
        )
    return parser
