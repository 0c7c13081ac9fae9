"""``runtime``'s process-group helpers: the check every mechanism makes before its first
collective, and how ``runtime.distributed`` takes a group down.

The deadlock it avoids (a gloo worker thread waiting for the GIL while the group's
destructor joins it) shows about once in 11 runs of lesson 12's monitor job, too
rarely for a test: ``python benchmarks/gloo_teardown.py`` repeats that job and counts.
This test pins the order that avoids it."""

import time

import pytest
import torch.distributed as dist

from ddp_course import runtime


@pytest.fixture
def calls(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    seen = []
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(runtime, "_let_gloo_workers_finish", lambda: seen.append("release GIL"))

    def destroy(*args, **kwargs):
        seen.append("destroy")
        real_destroy(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    return seen


def test_gloo_workers_get_the_gil_before_the_group_goes(calls):
    with runtime.distributed(backend="gloo", device="cpu", group_of_one=True) as ctx:
        assert ctx.backend == "gloo"
    assert calls == ["release GIL", "destroy"]


def test_the_release_also_follows_a_failing_script(calls):
    with pytest.raises(ZeroDivisionError):
        with runtime.distributed(backend="gloo", device="cpu", group_of_one=True):
            raise ZeroDivisionError("a failing script")
    assert calls == ["release GIL", "destroy"]


def test_the_release_lasts_its_stated_time():
    start = time.perf_counter()
    runtime._let_gloo_workers_finish()
    assert time.perf_counter() - start >= runtime.GLOO_QUIESCE_S * 0.9


def test_require_group_names_what_needs_it_and_what_to_do():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(RuntimeError, match="tensor parallelism needs a process group.*torchrun"):
        runtime.require_group(None, "tensor parallelism")


def test_require_group_gives_the_world_or_the_group_it_was_given():
    with runtime.distributed(backend="gloo", device="cpu", group_of_one=True):
        assert runtime.require_group() is dist.group.WORLD
        sub = dist.new_group([0])
        assert runtime.require_group(sub, "a test") is sub
