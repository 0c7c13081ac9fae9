"""FSDP from scratch as a module wrapper (``ddp_course.fsdp.FSDP``) on 2 gloo ranks, float64,
against one process and PyTorch's ``fully_shard`` on the same units: parameters after 5
SGD and AdamW steps, the shards' gradients, the collectives of a step and their bytes,
the full parameters held at the peak; bfloat16 compute against one process with the
same casts; frozen and tied parameters. One launch (``tests/workers/fsdp_check.py``)."""

import pytest
import worker_jobs

TOL = 1e-12  # float64: sums in another order, a few ulps after 5 steps
VARIANTS = ("reshard", "keep", "bf16", "frozen", "tied")
KEYS = [f"{v} {o}" for v in VARIANTS for o in ("sgd", "adamw")]


job = worker_jobs.worker_fixture("fsdp_check.py", ["--steps", "5"], world_sizes=[2])


@pytest.fixture(scope="module")
def ranks(job):
    return job["ranks"]


@pytest.mark.parametrize("key", KEYS)
def test_parameters_equal_one_process_and_fully_shard(ranks, key):
    for rank, r in enumerate(ranks):
        got = r[key]
        # bf16: the reference makes the same casts (module docstring of the worker), so
        # only the float64 average over ranks rounds: no more slack than float64.
        assert got["gap"] <= TOL < got["moved"] / 100, (rank, got["gap"], got["moved"])
        if "gap_fsdp2" in got:
            assert got["gap_fsdp2"] <= TOL, (rank, got["gap_fsdp2"])


@pytest.mark.parametrize("key", KEYS)
def test_shard_gradients_are_the_shards_rows_of_the_average(ranks, key):
    for rank, r in enumerate(ranks):
        for name, g in r[key]["grads"].items():
            assert g["shape"] == g["want_shape"], (rank, name, g)
            assert g["dtype"] == "torch.float64", (rank, name, g["dtype"])  # even from bf16
            assert g["off"] is None, (rank, name, g["off"])
    # Padding as fully_shard pads: 7 rows -> 4 + 3, 1 row -> 1 + 0 (an empty shard).
    shapes = [ranks[rank]["reshard sgd"]["grads"] for rank in range(2)]
    assert [s["inp.weight"]["shape"] for s in shapes] == [[4, 6], [3, 6]]
    assert [s["out.bias"]["shape"] for s in shapes] == [[1], [0]]


@pytest.mark.parametrize("key", KEYS)
def test_collectives_of_a_step_match_the_formula_and_fully_shard(ranks, key):
    for rank, r in enumerate(ranks):
        got, formula = r[key], r[key]["formula"]
        calls = got["calls"]
        for op, count, nbytes in (
            ("all_gather", "all_gathers", "all_gather_bytes"),
            ("reduce_scatter", "reduce_scatters", "reduce_scatter_bytes"),
        ):
            mine = [b for o, b, _ in calls if o == op]
            assert len(mine) == formula[count], (rank, op, mine)
            assert sum(mine) == formula[nbytes], (rank, op, mine)
        assert {o for o, _, _ in calls} == {"all_gather", "reduce_scatter"}, (rank, calls)
        if "fsdp2_calls" in got:  # the same calls, in another order (FSDP2 prefetches)
            assert sorted(map(tuple, calls)) == sorted(map(tuple, got["fsdp2_calls"])), rank


def test_the_formula_counts_units_and_padding(ranks):
    r = ranks[0]
    # Root: inp 7 rows -> 8 x 7 values, out 1 row -> 2 x 8; blocks 7 rows -> 8 x 8; float64.
    root, block = 8 * (8 * 6 + 8 + 2 * 7 + 2), 8 * (8 * 7 + 8)
    assert r["reshard sgd"]["unit_bytes"] == {"": root, "blocks.0": block, "blocks.1": block}
    # Each block gathered in forward and again in backward, the root once.
    assert r["reshard sgd"]["formula"]["all_gather_bytes"] == root + 4 * block
    assert r["keep sgd"]["formula"]["all_gather_bytes"] == root + 2 * block
    # bfloat16 on the wire: a quarter of float64's bytes; gradients reduced in float64.
    assert r["bf16 sgd"]["formula"]["all_gather_bytes"] * 4 == root + 4 * block
    assert r["bf16 sgd"]["formula"]["reduce_scatter_bytes"] == root + 2 * block
    assert {d for o, _, d in r["bf16 sgd"]["calls"] if o == "all_gather"} == {"torch.bfloat16"}
    assert {d for o, _, d in r["bf16 sgd"]["calls"] if o == "reduce_scatter"} == {"torch.float64"}
    # Frozen: the input layer's bias alone is reduced in the root, block 0 not at all.
    assert r["frozen sgd"]["formula"]["reduce_scatter_bytes"] == 8 * (8 + 2 * 7 + 2) + block


@pytest.mark.parametrize("key", KEYS)
def test_full_weights_held_one_unit_at_a_time(ranks, key):
    for rank, r in enumerate(ranks):
        got, units = r[key], r[key]["unit_bytes"]
        assert got["left_gathered"] == 0, (rank, "full parameters left after backward")
        if key.startswith(("keep", "tied")):  # every unit from its forward to its backward
            assert got["peak"] == sum(units.values()), (rank, got["peak"], units)
        else:  # the root, which never reshards after forward, and one block
            blocks = [b for name, b in units.items() if name]
            assert got["peak"] == units[""] + max(blocks) < sum(units.values()), (rank, got)


def test_bf16_moves_the_result_as_far_as_bfloat16_rounds(ranks):
    # Against the uncast float64 run: bf16 keeps 8 bits of mantissa (relative rounding
    # 2^-9 = 2e-3 a value), so the parameters differ by far more than float64's 1e-12;
    # with SGD (steps proportional to the gradient) by less than a tenth of what training
    # moved them. AdamW's first steps are about lr * sign(g): not bounded so.
    for r in ranks:
        for opt in ("sgd", "adamw"):
            got = r[f"bf16 {opt}"]
            assert got["gap_uncast"] > 1e-6, (opt, got["gap_uncast"])
        got = r["bf16 sgd"]
        assert got["gap_uncast"] < got["moved"] / 10, got["gap_uncast"]


def test_frozen_parameters_get_no_gradient_and_tied_across_units_is_refused(ranks):
    for r in ranks:
        for opt in ("sgd", "adamw"):
            assert r[f"frozen {opt}"]["frozen_grads"] == []
            assert "blocks.0.0.weight" not in r[f"frozen {opt}"]["grads"]
        message = r["tied_across_units"]
        assert message is not None and "another unit gathers" in message, message
