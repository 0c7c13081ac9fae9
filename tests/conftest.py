"""Shared fixtures: paths and the launcher, so tests run from any folder; most
notebooks are marked ``serial`` (see pyproject.toml)."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def root() -> pathlib.Path:
    """The repository's top folder."""
    return ROOT


@pytest.fixture
def workers() -> pathlib.Path:
    """Folder of the small scripts that multi-process tests launch."""
    return ROOT / "tests" / "workers"


# Notebooks whose assertions are about bytes, parameters and orders, never about
# time, and whose jobs have no short timeouts: they may run beside other tests.
# The others measure time (01, 02, 08, 10) or turn hangs into errors with timeouts
# of a few seconds (00, 03, 06, 11, 12) and run alone. 13-15 could run beside others
# too, but they keep both cores busy: beside another test each took twice as long
# (a fresh clone, 2 cores), which saved no time.
NOTEBOOKS_BESIDE_OTHERS = frozenset({"04_allreduce", "05_ddp", "07_ddp_internals", "09_sharding"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb" and item.path.stem not in NOTEBOOKS_BESIDE_OTHERS:
            item.add_marker(pytest.mark.serial)
