"""Lesson 16's 16_compile_mesh.py on 2 ranks: torch.compile with FSDP2 and tensor parallelism.

One run of the script (float64, aot_eager, a tiny TinyGPT) is shared by every test here.
FSDP2 with each block compiled before it is sharded trains as eager FSDP2 and one process
do, with the same collectives every step; Dynamo makes one graph that every block runs and
FSDP2's all-gathers and reduce-scatters stay outside it (eager hooks). Compiling the whole
sharded model gives up on TinyGPT's forward (a graph break in its loop over the blocks) and
compiles the blocks alone; with fullgraph=True it is refused. A tensor-parallel block
compiled issues the all-reduces of the eager one, as nodes of AOT autograd's graphs.
"""

import pathlib

import pytest

from ddp_course.harness import launch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts/16_compile_mesh.py"

TOL = 1e-12  # float64: compiled and eager differ by summation order at most
LAYERS, STEPS, RANKS = 2, 3, 2
ARGS = ["--d-model", "16", "--n-heads", "2", "--n-layers", str(LAYERS), "--seq-len", "16"]
ARGS += ["--batch-size", "4", "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def job():
    return launch.torchrun(
        SCRIPT,
        ARGS,
        nproc=RANKS,
        results=True,
        echo=False,
        timeout_s=240,
    ).results


def test_the_run_is_what_was_asked(job):
    assert job["world_size"] == RANKS and job["backend"] == "aot_eager"
    assert job["config"]["dtype"] == "float64" and job["fsdp"]["steps"] == STEPS


@pytest.mark.parametrize("variant", ["per_block", "per_block_checkpointed", "whole_model"])
def test_compiled_fsdp2_equals_eager_and_one_process(job, variant):
    fsdp = job["fsdp"]
    assert fsdp["moved"] > 1e-3  # the steps change the weights: equality means something
    assert fsdp["eager"]["gap_vs_one_process"] <= TOL
    r = fsdp[variant]
    assert r["error"] is None, r["error"]
    assert r["gap_vs_eager"] <= TOL and r["gap_vs_one_process"] <= TOL, r


@pytest.mark.parametrize("variant", ["per_block", "per_block_checkpointed", "whole_model"])
def test_compiled_fsdp2_runs_the_collectives_of_eager(job, variant):
    eager, compiled = job["fsdp"]["eager"]["collectives"], job["fsdp"][variant]["collectives"]
    assert len(compiled) == STEPS
    assert compiled == eager  # every step: calls per op and mesh dimension, bytes per call
    assert job["fsdp"][variant]["collectives_equal_eager"]
    # Per step: each block and the root gathered for forward, the blocks again for backward
    # (the root stays gathered), one reduce-scatter per unit.
    for step in compiled:
        assert step["counts"] == {
            "all_gather shard": 2 * LAYERS + 1,
            "reduce_scatter shard": LAYERS + 1,
        }


def test_one_graph_serves_every_block_and_holds_no_fsdp2_collective(job):
    graphs = job["fsdp"]["per_block"]["graphs"]
    # The blocks share their code and their guards pass: Dynamo reuses the first's graph
    # (parameters are its inputs), once per block per step.
    assert graphs["count"] == 1 and graphs["runs"] == [LAYERS * STEPS]
    assert "scaled_dot_product_attention" in graphs["ops"][0]
    assert "embedding" not in graphs["ops"][0]  # a block's graph, not the model's
    # FSDP2's hooks run eagerly around the graph: its collectives are not nodes of it.
    assert graphs["collective_nodes_dynamo"] == {}
    assert graphs["collective_nodes_aot"] == {"forward": {}, "backward": {}}
    assert job["fsdp"]["per_block"]["graph_breaks"] == 0
    assert job["fsdp"]["per_block"]["frames_skipped"] == []


def test_a_checkpointed_block_recomputes_its_forward_inside_the_backward_graph(job):
    plain = job["fsdp"]["per_block"]["graphs"]
    ckpt = job["fsdp"]["per_block_checkpointed"]["graphs"]
    assert ckpt["count"] == 1 and ckpt["runs"] == [LAYERS * STEPS]
    assert ckpt["aot_ops"]["backward"] > plain["aot_ops"]["backward"]
    assert ckpt["collective_nodes_aot"] == {"forward": {}, "backward": {}}


def test_whole_model_compile_falls_back_to_the_blocks(job):
    r = job["fsdp"]["whole_model"]
    assert "graph break in loop" in r["break_reasons"]
    assert "Attempted to call function marked as skipped" in r["break_reasons"]
    # TinyGPT.forward runs eagerly; each block's forward is compiled, as per_block's.
    assert [f.split(" (")[0] for f in r["frames_skipped"]] == ["forward"]
    assert "models.py" in r["frames_skipped"][0]
    assert r["graphs"]["count"] == 1 and r["graphs"]["runs"] == [LAYERS * STEPS]
    assert r["graphs"]["ops"] == job["fsdp"]["per_block"]["graphs"]["ops"]
    full = job["fsdp"]["whole_model_fullgraph"]
    assert "Attempted to call function marked as skipped" in full["error"]
    assert full["graphs"]["count"] == 0


def test_compiled_tensor_parallel_block_equals_eager_and_one_process(job):
    for name, gaps in job["tp"]["gaps"].items():
        assert max(gaps.values()) <= TOL, (name, gaps)


def test_compiled_tensor_parallel_runs_its_all_reduces_inside_the_graph(job):
    tp = job["tp"]
    compiled = tp["compiled"]
    assert compiled["collectives"] == tp["eager"]["collectives"] and tp["collectives_equal_eager"]
    # Forward: after attn.proj and mlp.fc2 (row-parallel); backward: the gradient of the
    # replicated input of each column-parallel layer, q, k, v and fc1...
    counts = {ph: c["counts"] for ph, c in compiled["collectives"].items()}
    assert counts == {"forward": {"all_reduce tp": 2}, "backward": {"all_reduce tp": 4}}
    graphs = compiled["graphs"]
    assert graphs["count"] == 1 and compiled["frames_skipped"] == []
    # ...which Dynamo's graph holds as DTensor calls and AOT autograd's as collectives.
    assert graphs["collective_nodes_dynamo"] == {}
    assert graphs["dtensor_nodes_dynamo"]["redistribute"] == 6
    aot = graphs["collective_nodes_aot"]
    for phase in ("forward", "backward"):
        calls = counts[phase]["all_reduce tp"]
        assert aot[phase]["_c10d_functional.all_reduce.default"] == calls >= 1
        assert aot[phase]["_c10d_functional.wait_tensor.default"] == calls
