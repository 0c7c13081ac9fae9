"""Shared fixtures: paths and the launcher, so tests run from any folder; notebooks
are marked ``serial`` (see pyproject.toml)."""

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # nbval's items are the notebooks' cells: they launch jobs that use both
    # cores, so they never run beside another test.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.serial)
