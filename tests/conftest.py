"""Shared fixtures: paths and the launcher, so tests run from any folder."""

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
