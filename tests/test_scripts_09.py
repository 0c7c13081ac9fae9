"""Lesson 09's scripts with tiny settings: 09_zero.py as one plain process (the notebook
runs it under torchrun on 1 to 4 ranks); 09_fsdp.py under torchrun with 2 ranks, saving a
sharded checkpoint and loading it back in the same job, then loading it with 3 ranks.
The scripts assert equality with DDP themselves (assert_close); these tests check what
they report."""

import pathlib

import pytest

from ddp_course import launch
from ddp_course.sharding import FP32_ADAM, state_bytes_per_rank

ROOT = pathlib.Path(__file__).resolve().parent.parent
FP32 = 4  # bytes per parameter and per gradient; Adam keeps two such values more
FSDP = ("FSDP2 reshard_after_forward=True", "FSDP2 reshard_after_forward=False")


def test_zero_script_as_plain_python(root):
    job = launch.python(root / "scripts/09_zero.py", ["--steps", "2", "--hidden", "32"],
                        results=True, echo=False, timeout_s=300)  # fmt: skip
    rows = job.results["rows"]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        psi = r["num_params"]
        held = r["per_rank"][0]["held"]
        # One rank holds everything: 4 + 4 + 8 bytes a parameter, + Adam's step counters.
        assert held == {"params": FP32 * psi, "grads": FP32 * psi,
                        "optimizer": 2 * FP32 * psi + 4 * r["param_tensors"]}  # fmt: skip
        assert r["formula"] == state_bytes_per_rank(r["stage"], psi, 1, FP32_ADAM).__dict__
        assert r["gap"] <= 1e-6
        # DDP all-reduces 2 Psi values (paper's units); stage 3 gathers once more: 3 Psi.
        assert r["sent_bytes"] == (3 if r["stage"] == 3 else 2) * FP32 * psi


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "09_checkpoint"
    job = launch.torchrun(ROOT / "scripts/09_fsdp.py", ["--checkpoint", str(folder)], nproc=2,
                          results=True, echo=False, timeout_s=300)  # fmt: skip
    return folder, job.results


def test_fsdp_and_zero_redundancy_equal_ddp(saved):
    r = saved[1]
    variants, psi = r["variants"], r["num_params"]
    ddp = variants["DDP"]
    for kind, per_rank in variants.items():
        assert len(per_rank) == 2
        for got in per_rank:
            assert got["losses"] == pytest.approx(ddp[0]["losses"], abs=1e-6), kind
            assert got["gap"] <= 1e-6, kind
    assert r["unbroadcast_gap"] > 1e-3  # fully_shard does not broadcast rank 0's weights
    # ZeroRedundancyOptimizer shards Adam's state by whole tensors: the ranks' parts add
    # up to DDP's, each rank holds less, parameters and gradients stay whole.
    zro = variants["ZeroRedundancyOptimizer"]
    assert sum(g["held"]["optimizer"] for g in zro) == ddp[0]["held"]["optimizer"]
    for got in zro:
        assert got["held"]["optimizer"] < ddp[0]["held"]["optimizer"]
        assert got["held"]["params"] == got["held"]["grads"] == FP32 * psi
    # FSDP2 holds a half of everything on each of 2 ranks: ZeRO stage 3, within 10%.
    formula = r["formula"]["3"]
    for kind in FSDP:
        for got in variants[kind]:
            for part, want in formula.items():
                assert got["held"][part] == pytest.approx(want, rel=0.1), (kind, part)


def test_reshard_after_forward_trades_memory_for_all_gathers(saved):
    r = saved[1]
    on, off = (r["variants"][kind][0] for kind in FSDP)
    linears = 3  # the MLP's fully_shard units that own parameters
    assert on["all_gathers_per_step"] == 2 * linears  # again before backward
    assert off["all_gathers_per_step"] == linears
    assert on["unsharded_bytes_after_forward"] == 0
    assert off["unsharded_bytes_after_forward"] == FP32 * r["num_params"]


def check_resumed(got, nproc):
    assert got["world_size"] == nproc
    assert got["changed_by_load"] > 0  # the fresh model started elsewhere
    assert got["optim_steps"] == [3.0]  # Adam's step counters came back too
    # Each parameter is split by rows into ceil(rows / nproc)-row shards, in rank order.
    bias = [shards["net.5.bias"] for shards in got["local_numel"]]
    assert sum(bias) == 10 and bias[0] == -(-10 // nproc)


def test_sharded_checkpoint_loads_at_the_same_world_size(saved):
    # The script asserts, bit for bit, that the loaded model and Adam state gathered to
    # rank 0 equal the full state dict it saved; a failure fails the job.
    folder, r = saved
    assert r["checkpoint"]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in folder.iterdir()) == ["full.pt", "sharded"]
    check_resumed(r["reload"], 2)


def test_sharded_checkpoint_loads_at_another_world_size(saved):
    folder, _ = saved
    job = launch.torchrun(ROOT / "scripts/09_fsdp.py", ["--resume", str(folder)], nproc=3,
                          results=True, echo=False, timeout_s=300)  # fmt: skip
    check_resumed(job.results["resume"], 3)
