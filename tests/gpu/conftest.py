"""Fixtures of every GPU test file."""

import pytest

from ddp_course import runtime


@pytest.fixture(autouse=True)
def launcher_plans_the_device(monkeypatch):
    # A DDP_COURSE_DEVICE left in the shell would override the launcher's device plan.
    monkeypatch.delenv(runtime.DEVICE_ENV, raising=False)
