"""Lesson 17's 17_diloco.py on 2 ranks: DiLoCo at H=1 equals DDP step by step, the ranks agree
after every synchronisation and drift between, and DiLoCo all-reduces H times fewer bytes
than DDP at equal tokens (the module's own tests: tests/multiprocess/test_local_sgd.py)."""

import pathlib

import pytest

from ddp_course.harness import launch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts/17_diloco.py"


@pytest.fixture(scope="module")
def job():
    args = ["--steps", "20", "--sync-every", "5", "10", "--eval-every", "10"]
    args += ["--part", "check", "train", "streaming", "labs", "--fragments", "5"]
    args += ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "16"]
    return launch.torchrun(SCRIPT, args, nproc=2, results=True, echo=False).results


def test_diloco_at_h1_is_ddp_and_ranks_agree_only_after_syncs(job):
    check = job["check"]
    assert max(check["h1_vs_ddp_per_step"]) <= 1e-12
    assert [s["rank_spread"] == 0.0 for s in check["h2_spread"]] == [False, True] * 2


def test_h_times_fewer_all_reduces_and_bytes(job):
    methods = job["methods"]
    one = methods["ddp"]["param_bytes"]
    assert methods["ddp"]["all_reduces"] == 20 and methods["ddp"]["bytes"] == 20 * one
    for h in (5, 10):
        m = methods[f"diloco H={h}"]
        assert m["all_reduces"] == 20 // h and m["bytes"] == 20 // h * one
        assert all(e["rank_spread"] == 0.0 for e in m["evals"])
    assert all(len(m["step_s"]) == 20 and min(m["step_s"]) > 0 for m in methods.values())


def test_a_rank_that_keeps_its_own_parameters_is_apart_after_every_sync(job):
    labs = job["labs"]
    assert all(e["rank_spread"] == 0.0 for e in labs["every rank loads"]["evals"])
    assert all(e["rank_spread"] > 1e-4 for e in labs["the last rank keeps its own"]["evals"])


def test_streaming_diloco_sends_diloco_bytes_in_smaller_all_reduces(job):
    streaming, whole = job["streaming"], job["methods"]["diloco H=10"]
    assert streaming["method"] == "streaming H=10 P=5"
    assert streaming["all_reduces"] == 20 // 2  # one fragment every H/P = 2 steps
    assert streaming["bytes"] == whole["bytes"]
    assert streaming["largest_all_reduce"] < whole["largest_all_reduce"] == whole["param_bytes"]
