"""Fixtures of the one-process tests."""

import gc

import pytest
import torch.distributed as dist

from ddp_course.runtime import DistContext


@pytest.fixture(scope="module")
def group():
    """A single-process gloo group (world size 1, no launcher) for code that asks a group
    for its rank and size or, like DDP, needs one; destroyed after the module's tests."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistContext(backend="gloo")
    finally:
        gc.collect()  # DDP's reducer must go before the group (see runtime.distributed)
        dist.destroy_process_group()
