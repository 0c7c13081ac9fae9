"""What the test workers share: their command line, and one comparison that reports
instead of raising.

A worker runs collectives on every rank, so a failed comparison must not raise on one
rank and leave the others waiting in the next collective: each check is recorded
(``None`` when it passed) and the test reads the records of every rank.
"""

import argparse

import torch

TINY_GPT = {"d_model": 16, "n_heads": 4, "n_layers": 2, "seq_len": 8, "batch_size": 2}
"""The TinyGPT the tensor- and sequence-parallel workers split, as ``parse_args`` keywords."""


def parse_args(**defaults) -> argparse.Namespace:
    """The worker's flags: ``--results PATH`` and one flag per keyword, typed by its default.

    ``parse_args(d_model=16, lr=0.1)`` reads ``--d-model`` (int, default 16),
    ``--lr`` (float, default 0.1) and ``--results`` (default None).
    """
    parser = argparse.ArgumentParser()
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--results")
    return parser.parse_args()


def mismatch(actual: torch.Tensor, expected: torch.Tensor, **tolerance) -> str | None:
    """None when ``torch.testing.assert_close(actual, expected, **tolerance)`` passes,
    else the first line of its message (never raises: collectives go on)."""
    try:
        torch.testing.assert_close(actual, expected, **tolerance)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None
