"""Lesson 16's 16_compile.py on 2 ranks: DDP with torch.compile, and recompiles across ranks.

One run of the script's parts "ddp" and "recompile" (float64, aot_eager, the MLP of six
Linear(256, 256) layers, 1 MiB buckets) is shared by the tests. The DDP optimizer cuts one
graph per bucket, each reading exactly its bucket's parameters, and keeps eager's overlap; one
graph (optimize_ddp=False) starts every all-reduce after backward; compiled autograd puts one
functional all-reduce per parameter inside its backward graph; every variant's parameters and
collectives equal eager DDP's. A rank that recompiles alone makes the other wait, and the fixes
leave every rank with the same graphs. The part "speed" runs in notebook 16 (Inductor).
"""

import pathlib
import re

import pytest

from ddp_course.harness import launch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts/16_compile.py"
LAYER = 256 * 256 * 8 + 256 * 8  # one Linear(256, 256) in float64, bytes
TOL = 1e-12


@pytest.fixture(scope="module")
def job():
    return launch.torchrun(
        SCRIPT,
        ["--part", "ddp", "recompile", "--steps", "6"],
        nproc=2,
        results=True,
        echo=False,
        timeout_s=240,
    ).results


def test_one_graph_per_bucket_each_reading_its_bucket(job):
    split = job["ddp"]["DDP(compile(m))"]
    buckets = split["collectives"]["all_reduce"]
    assert buckets == [2 * LAYER] * 3
    assert split["graphs"] == len(buckets)
    assert split["graph_parameter_bytes"] == buckets[::-1]
    assert job["ddp"]["compile(DDP(m))"]["graph_parameter_bytes"] == buckets[::-1]


def test_the_split_keeps_the_overlap_and_one_graph_loses_it(job):
    ddp = job["ddp"]
    assert ddp["eager"]["all_reduces_before_input_gradient"] == 2
    assert ddp["DDP(compile(m))"]["all_reduces_before_input_gradient"] == 2
    assert ddp["one graph"]["graphs"] == 1
    assert ddp["one graph"]["all_reduces_before_input_gradient"] == 0
    assert ddp["one graph"]["events"][0] == "input gradient"


@pytest.mark.parametrize(
    "variant,eager",
    [
        ("DDP(compile(m))", "eager"),
        ("compile(DDP(m))", "eager"),
        ("compiled, find_unused", "eager, find_unused"),
        ("compiled, no_sync", "eager, no_sync"),
    ],
)
def test_compiled_ddp_runs_eagers_collectives(job, variant, eager):
    assert job["ddp"][variant]["collectives"] == job["ddp"][eager]["collectives"]
    assert job["ddp"][variant]["collective_paths"] == ["c10d"]


def test_find_unused_adds_the_bitmap_all_reduce(job):
    sizes = job["ddp"]["eager, find_unused"]["collectives"]["all_reduce"]
    assert sum(sizes) > 6 * LAYER and 6 * LAYER not in sizes  # one more, a small one


def test_compiled_autograd_all_reduces_every_parameter_inside_the_graph(job):
    ca = job["ddp"]["compiled autograd"]
    in_graph = [op for ops in ca["graph_collectives"] for op in ops if "all_reduce" in op]
    assert len(in_graph) == len(ca["collectives"]["all_reduce"]) == 12
    assert sorted(ca["collectives"]["all_reduce"]) == sorted([256 * 256 * 8, 256 * 8] * 6)
    assert ca["collective_paths"] == ["functional"]
    assert ca["all_reduces_before_input_gradient"] is None  # no comm hook runs


def test_every_variant_trains_as_eager_ddp(job):
    gaps = {name: v["max_param_diff_vs_eager"] for name, v in job["ddp"].items()}
    assert all(g is not None and g <= TOL for g in gaps.values()), gaps


@pytest.mark.parametrize("what", ["shape", "python value"])
def test_a_recompile_on_one_rank_is_a_straggler_and_the_fix_removes_it(job, what):
    rec = job["recompile"]
    odd = rec["odd_step"]
    written, fixed = rec[f"{what}, as written"], rec[f"{what}, fixed"]
    assert [len(r["recompiles"]) for r in written] == [0, 1]
    assert written[1]["graphs"] > written[0]["graphs"]
    usual = sorted(written[0]["step_s"][1:])[2]
    assert written[0]["step_s"][odd] > 0.5 * written[1]["step_s"][odd] > 5 * usual
    assert all(r["recompiles"] == [] for r in fixed)
    assert fixed[0]["graphs"] == fixed[1]["graphs"]


def test_recompile_reasons_name_the_guard_and_no_folder(job):
    shape = job["recompile"]["shape, as written"][1]["recompiles"][0]
    value = job["recompile"]["python value, as written"][1]["recompiles"][0]
    assert "tensor 'x' size mismatch at index 0. expected 8, actual 6" in shape
    assert "scale == 1.0" in value
    assert not re.search(r"(^|[\s\"'])/\w", shape + value)  # no absolute path


def test_a_graph_break_in_every_gradient_hook_runs_the_all_reduces_outside_graphs(job):
    broken = job["ddp"]["hooks with .item(), compiled autograd"]
    fixed = job["ddp"]["hooks, compiled autograd"]
    per_graph = [sum("all_reduce" in op for op in ops) for ops in fixed["graph_collectives"]]
    assert broken["graph_breaks"] >= 12 and broken["collective_paths"] == ["c10d"]
    assert fixed["graph_breaks"] == 0 and max(per_graph) == 12
    assert fixed["collective_paths"] == ["functional"]


def test_the_second_step_broadcasts_the_rebuilt_bucket_order(job):
    for name in ("eager", "DDP(compile(m))"):
        v = job["ddp"][name]
        assert v["first_step_collectives"] == {"all_reduce": [6 * LAYER]}
        assert len(v["second_step_collectives"]["broadcast"]) == 2
