"""Dropout in the course's tensor- and sequence-parallel TinyGPT (ParallelGPT), on 2 and 4
gloo ranks: masks differ across ranks on each rank's heads and sequence shard, agree on the
replicated regions, and change from step to step; the replicated parameters stay equal on
every rank when training with dropout. Three mistakes patched in must each be caught.

Megatron-LM keeps a second RNG state per tensor-parallel rank for the sharded regions
(model_parallel_cuda_manual_seed, get_cuda_rng_tracker().fork()); tp.ParallelRNG is it.
"""

import worker_jobs

LAYERS = 2
ARGS = [
    "--d-model",
    "16",
    "--n-heads",
    "4",
    "--n-layers",
    str(LAYERS),
    "--seq-len",
    "8",
    "--batch-size",
    "2",
]
SHARDED = ("heads", "sequence shard")


job = worker_jobs.worker_fixture("tp_dropout_check.py", ARGS, world_sizes=[2, 4])


def wrong(report):
    """What the dropout rule forbids, per layout and region: a list of complaints."""
    out = []
    for mode in ("tp", "sp"):
        r = report[mode]
        if r["calls"] != [r["expected_calls"]] * 2:
            out.append(f"{mode}: dropout calls {r['calls']}")
        for region, row in r["regions"].items():
            must_agree = region not in SHARDED
            if any(eq != must_agree for eq in row["equal_on_every_rank"]):
                out.append(f"{mode} {region}: equal on every rank {row['equal_on_every_rank']}")
            if any(row["repeats_next_step"]):
                out.append(f"{mode} {region}: the same mask again at the next step")
        if r["replicas_disagree"]:
            out.append(f"{mode}: replicas disagree {r['replicas_disagree']}")
    return out


def test_masks_follow_the_rule_on_every_rank(job):
    for rank, report in enumerate(job["variants"]["as_written"]):
        assert wrong(report) == [], rank
        # Every region was seen, and dropout 0.5 dropped about half of it.
        assert set(report["tp"]["regions"]) == {
            "replicated embeddings",
            "heads",
            "replicated residual",
        }
        assert set(report["sp"]["regions"]) == {"replicated embeddings", "heads", "sequence shard"}
        for mode in ("tp", "sp"):
            for row in report[mode]["regions"].values():
                assert 0.2 < row["dropped"] < 0.6, row


def test_sharded_shapes_are_this_ranks_part(job):
    n = job["world_size"]
    report = job["variants"]["as_written"][0]
    assert report["sp"]["regions"]["sequence shard"]["shape"] == [2, 8 // n, 16]
    assert report["tp"]["regions"]["replicated residual"]["shape"] == [2, 8, 16]
    assert report["tp"]["regions"]["heads"]["shape"] == [2, 4 // n, 8, 8]


def test_default_generator_for_the_heads_is_caught(job):
    # Every rank draws the same mask for its own heads (and, with SP, positions).
    for report in job["variants"]["default_generator_everywhere"]:
        complaints = wrong(report)
        assert any("tp heads: equal on every rank" in c for c in complaints), complaints
        assert any("sp sequence shard: equal on every rank" in c for c in complaints)


def test_reseeding_every_step_is_caught(job):
    for report in job["variants"]["reseeded_every_step"]:
        complaints = wrong(report)
        assert "tp heads: the same mask again at the next step" in complaints, complaints
        assert "sp sequence shard: the same mask again at the next step" in complaints
        assert not any("replicated" in c for c in complaints)


def test_seed_plus_rank_breaks_the_replicas(job):
    for report in job["variants"]["default_generator_seed_plus_rank"]:
        complaints = wrong(report)
        assert any("tp replicated residual: equal on every rank" in c for c in complaints)
        assert any("tp: replicas disagree" in c for c in complaints), complaints
