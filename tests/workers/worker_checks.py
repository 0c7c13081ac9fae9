"""What the test workers share: one comparison that reports instead of raising.

A worker runs collectives on every rank, so a failed comparison must not raise on one
rank and leave the others waiting in the next collective: each check is recorded
(``None`` when it passed) and the test reads the records of every rank.
"""

import torch


def mismatch(actual: torch.Tensor, expected: torch.Tensor, **tolerance) -> str | None:
    """None when ``torch.testing.assert_close(actual, expected, **tolerance)`` passes,
    else the first line of its message (never raises: collectives go on)."""
    try:
        torch.testing.assert_close(actual, expected, **tolerance)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None
