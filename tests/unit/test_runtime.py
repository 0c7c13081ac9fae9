"""runtime: single-process context, device and backend choice, logging, the check every
mechanism makes before its first collective, and how ``distributed`` takes a group down.

The teardown deadlock ``distributed`` avoids (a gloo worker thread waiting for the GIL
while the group's destructor joins it) showed once in 62 runs of lesson 12's monitor
job, too rarely for a test: ``python benchmarks/gloo_teardown.py`` repeats that job and
counts. The tests below pin the order that avoids it."""

import dataclasses
import logging
import time

import pytest
import torch
import torch.distributed as dist

from ddp_course import runtime


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_plain_process_gets_a_single_process_context(no_torchrun_env):
    with runtime.distributed(device="cpu") as ctx:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, None)
        assert ctx.is_main and not ctx.is_distributed
        assert not dist.is_initialized()
        runtime.barrier(ctx)  # a no-op, not a hang
        with runtime.rank0_first(ctx):
            pass


def test_context_is_frozen():
    ctx = runtime.DistContext()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 1


def test_backend_follows_the_device_not_availability():
    assert runtime.pick_backend(torch.device("cpu")) == "gloo"
    assert runtime.pick_backend(torch.device("cuda", 1)) == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cpu_machine_picks_cpu():
    assert runtime.pick_device(0) == torch.device("cpu")


def test_rank_outside_world_size_is_rejected(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(RuntimeError, match="does not fit WORLD_SIZE=2"):
        with runtime.distributed(device="cpu"):
            pass


def test_world_size_without_rank_is_rejected(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        with runtime.distributed(device="cpu"):
            pass


def test_group_is_destroyed_even_when_the_body_raises(monkeypatch, tmp_path):
    from ddp_course.harness.ports import free_port

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(ValueError, match="inside"):
        with runtime.distributed(device="cpu") as ctx:
            assert ctx.is_distributed and ctx.backend == "gloo"
            assert dist.get_world_size() == 1
            raise ValueError("inside")
    assert not dist.is_initialized()
    assert (tmp_path / "error.json").exists()  # torchrun's summary can show it


def test_logger_prefixes_the_rank_and_quietens_other_ranks(capsys):
    main = runtime.get_logger(runtime.DistContext(rank=0, world_size=2), "t1")
    other = runtime.get_logger(runtime.DistContext(rank=1, world_size=2), "t1")
    main.info("from zero")
    other.info("hidden")
    other.warning("shown")
    out = capsys.readouterr().out
    assert "[rank 0/2] from zero" in out
    assert "hidden" not in out
    assert "[rank 1/2] shown" in out
    assert other.level == logging.WARNING


def test_seed_everything_repeats_draws():
    runtime.seed_everything(7)
    a = torch.rand(3)
    runtime.seed_everything(7)
    torch.testing.assert_close(torch.rand(3), a)


def test_group_of_one_runs_collectives_and_is_destroyed(no_torchrun_env):
    with runtime.distributed(device="cpu", group_of_one=True) as ctx:
        assert (ctx.world_size, ctx.backend, ctx.is_distributed) == (1, "gloo", True)
        t = torch.tensor([3.0])
        dist.all_reduce(t)  # a group of one: the sum is the tensor itself
        assert t.item() == 3.0 and dist.get_world_size() == 1
    assert not dist.is_initialized()


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
    assert time.perf_counter() - start >= runtime.GLOO_RELEASE_S * 0.9


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
