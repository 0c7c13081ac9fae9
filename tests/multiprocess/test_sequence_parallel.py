"""Tensor-parallel attention and sequence parallelism (TinyGPT) against one process, on 2 and 4
gloo ranks, in float64; collectives counted against the formula; three mistakes caught; the
bytes a block saves for backward against Korthikanti et al. 2022; the seed lab (dropout:
test_tp_dropout.py).

Formulas (per block, activations [B, T, d] of K = B T d x 8 bytes):
- tensor parallelism (Shoeybi et al. 2019, section 3): 2 all-reduces of K forward, 2 backward;
- with sequence parallelism (Korthikanti et al. 2022, section 4.2.2): 2 all-gathers and
  2 reduce-scatters of K forward; backward the same plus 2 all-gathers that rebuild the
  inputs of q/k/v and fc1 (only this rank's shard of them was saved); a ring moves
  2(N-1)/N K per rank for an all-reduce and (N-1)/N K for the other two, so forward's bytes
  on the wire are equal and backward's 3/2 of TP's; plus one all-reduce of the 6 d
  sequence-parallel parameters' gradients per block after backward.
"""

import worker_jobs

from ddp_course.mesh_predictions import saved_block_bytes_formula

D, HEADS, LAYERS, SEQ, BATCH, STEPS = 16, 4, 2, 8, 2, 5
ARGS = [
    "--d-model",
    str(D),
    "--n-heads",
    str(HEADS),
    "--n-layers",
    str(LAYERS),
    "--seq-len",
    str(SEQ),
    "--batch-size",
    str(BATCH),
    "--steps",
    str(STEPS),
]
K = BATCH * SEQ * D * 8  # one [B, T, d] float64 activation, bytes
WIRE = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # x (N-1)/N K per rank, ring


job = worker_jobs.worker_fixture("tp_gpt_check.py", ARGS, world_sizes=[2, 4])


def failed(report):
    return set(worker_jobs.failed(report))


def counts(calls, phase):
    out = {}
    for c in calls:
        if c["phase"].split()[0] == phase:
            out.setdefault(c["op"], []).append(c["bytes"])
    return out


def test_block_and_gpt_equal_one_process_with_and_without_sequence_parallelism(job):
    for rank, mine in enumerate(job["variants"]["as_written"]):
        for part in ("block tp", "block sp", "gpt tp", "gpt sp"):
            assert mine[part]["fails"], f"rank {rank} {part}: nothing checked"
            assert failed(mine[part]) == set(), f"rank {rank} {part}"
        # Every parameter of the block and of TinyGPT was compared.
        assert len(mine["block tp"]["fails"]) == 2 + 16
        assert {"input_grad", "grad ln1.weight", "grad attn.q.weight"} <= set(
            mine["block sp"]["fails"]
        )
        assert len(mine["gpt sp"]["fails"]) == 5 + 16 * LAYERS
        assert mine["gpt sp"]["replicas_disagree"] == []
        assert len(mine["gpt sp"]["losses"]) == STEPS
        assert mine["gpt sp"]["losses"][-1] < mine["gpt sp"]["losses"][0]


def test_collectives_per_block_match_the_formula(job):
    n = job["world_size"]
    for mine in job["variants"]["as_written"]:
        tp_calls, sp_calls = mine["block tp"]["calls"], mine["block sp"]["calls"]
        assert counts(tp_calls, "forward") == {"all_reduce": [K, K]}
        assert counts(tp_calls, "backward") == {"all_reduce": [K, K]}
        assert counts(tp_calls, "grads") == {}
        assert counts(sp_calls, "forward") == {"all_gather": [K, K], "reduce_scatter": [K, K]}
        # g-bar's backward (2) and the inputs of q/k/v and fc1 gathered again (2).
        assert counts(sp_calls, "backward") == {"all_gather": [K] * 4, "reduce_scatter": [K, K]}
        assert counts(sp_calls, "grads") == {"all_reduce": [6 * D * 8]}

        def wire(calls, phase):
            return sum(
                WIRE[op] * (n - 1) * b / n for op, bs in counts(calls, phase).items() for b in bs
            )

        # Same bytes on the wire forward (Korthikanti et al. 2022, section 4.2.2); backward
        # pays the two extra all-gathers.
        assert wire(tp_calls, "forward") == wire(sp_calls, "forward") == 4 * (n - 1) * K / n
        assert wire(tp_calls, "backward") == 4 * (n - 1) * K / n
        assert wire(sp_calls, "backward") == 6 * (n - 1) * K / n


def test_collectives_per_training_step(job):
    for mine in job["variants"]["as_written"]:
        tp_calls, sp_calls = mine["gpt tp"]["calls"], mine["gpt sp"]["calls"]
        assert counts(tp_calls, "forward") == {"all_reduce": [K] * 2 * LAYERS}
        assert counts(tp_calls, "backward") == {"all_reduce": [K] * 2 * LAYERS}
        assert counts(tp_calls, "grads") == {}
        # One more all-gather each way: into the replicated final LayerNorm (forward),
        # out of the replicated embeddings (backward).
        assert counts(sp_calls, "forward") == {
            "all_gather": [K] * (2 * LAYERS + 1),
            "reduce_scatter": [K] * 2 * LAYERS,
        }
        assert counts(sp_calls, "backward") == {
            "all_gather": [K] * (4 * LAYERS + 1),
            "reduce_scatter": [K] * 2 * LAYERS,
        }
        assert counts(sp_calls, "grads") == {"all_reduce": [6 * D * LAYERS * 8]}


def test_layernorm_activations_shrink_n_times(job):
    n, saved = job["world_size"], job["layernorm_bytes"]
    # Two LayerNorms, each saving its input [B, T, d] and mean and rstd [B, T].
    assert saved["tp"] == 2 * (BATCH * SEQ * D + 2 * BATCH * SEQ) * 8
    assert saved["sp"] * n == saved["tp"]


def test_a_block_saves_what_korthikanti_counts(job):
    # Korthikanti et al. 2022, table 2: sbh(10 + 24/t) + 5as²b/t under TP, sbh 34/t + 5as²b/t
    # with SP, in 2-byte activations and 1-byte masks; here float64 and CPU dropout's
    # float64 mask (saved_block_bytes_formula says term by term).
    n, saved = job["world_size"], job["block_bytes"]
    for mode, seq_par in (("tp", False), ("sp", True)):
        want = saved_block_bytes_formula(BATCH, SEQ, D, HEADS, n, seq_par)
        assert saved[mode]["bytes"] == want, mode
    # With SP every term is divided by N (but the causal mask, SEQ² bytes)...
    one = saved_block_bytes_formula(BATCH, SEQ, D, HEADS, 1, False)
    assert saved["sp"]["bytes"] - SEQ * SEQ == (one - SEQ * SEQ) // n
    # ...so no [B, T, d] activation is kept: only the MLP's hidden [B, T, 4d/N] can have
    # that shape, where 4d/N = d.
    whole = [[BATCH, SEQ, D], [BATCH * SEQ, D]]
    assert [s for s in saved["tp"]["shapes"] if s in whole]  # TP keeps several
    kept = [s for s in saved["sp"]["shapes"] if s in whole]
    assert kept == ([] if 4 * D // n != D else [[BATCH, SEQ, D], [BATCH * SEQ, D]]), kept


def test_each_rank_holds_its_share_of_the_weights(job):
    n = job["world_size"]
    mine = job["variants"]["as_written"][0]["gpt tp"]
    per_block_sharded = 4 * D * D + 3 * D + 2 * 4 * D * D + 4 * D  # q,k,v,proj W; q,k,v b; fc1,fc2
    per_block_replicated = 4 * D + D + D  # ln1, ln2, proj bias, fc2 bias
    rest = 256 * D + SEQ * D + 2 * D + D * 256
    assert mine["params_whole"] == LAYERS * (per_block_sharded + per_block_replicated) + rest
    assert mine["params_per_rank"] == (
        LAYERS * (per_block_sharded // n + per_block_replicated) + rest
    )


def test_f_without_its_backward_all_reduce_is_caught(job):
    for mine in job["variants"]["f_backward_without_all_reduce"]:
        block = failed(mine["block tp"])
        assert "output" not in block  # only gradients reveal it
        assert {"input_grad", "grad ln1.weight", "grad attn.q.weight"} <= block
        assert counts(mine["block tp"]["calls"], "backward") == {}
        assert failed(mine["gpt tp"]) and mine["gpt tp"]["replicas_disagree"]
        # Sequence parallelism does not use f: unaffected.
        assert failed(mine["block sp"]) == set() and failed(mine["gpt sp"]) == set()


def test_sequence_parallel_region_without_its_all_gather_is_caught(job):
    for mine in job["variants"]["sp_without_all_gather"]:
        assert {"output", "input_grad"} <= failed(mine["block sp"])
        assert counts(mine["block sp"]["calls"], "forward") == {"reduce_scatter": [K, K]}
        assert failed(mine["gpt sp"])
        assert failed(mine["block tp"]) == set() and failed(mine["gpt tp"]) == set()


def test_layernorm_gradient_not_reduced_is_caught(job):
    for mine in job["variants"]["ln_grad_not_reduced"]:
        # Only the parameters acting on a sequence shard are wrong...
        assert failed(mine["block sp"]) == {
            f"grad {n}"
            for n in (
                "ln1.weight",
                "ln1.bias",
                "ln2.weight",
                "ln2.bias",
                "attn.proj.bias",
                "mlp.fc2.bias",
            )
        }
        # ...and the replicas drift apart across the tensor-parallel ranks.
        drift = set(mine["gpt sp"]["replicas_disagree"])
        assert {"blocks.0.ln1.weight", f"blocks.{LAYERS - 1}.mlp.fc2.bias"} <= drift
        assert "tok_emb.weight" not in drift
        assert failed(mine["gpt tp"]) == set()


def test_seed_lab(job):
    lab = job["seed_lab"]
    # seed + rank: the shards of rank 0 come from the one-process model, the others not;
    # replicated embeddings and head differ across ranks.
    assert "blocks.0.attn.q.weight" in lab["seed_plus_rank"]["differ_from_one_process"]
    assert {"tok_emb.weight", "head.weight"} <= set(lab["seed_plus_rank"]["replicas_disagree"])
    assert lab["same_seed"] == {"differ_from_one_process": [], "replicas_disagree": []}


def test_a_sequence_the_ranks_cannot_share_gets_a_clear_error(job):
    n = job["world_size"]
    assert (
        f"sequence length {SEQ - 1} is not divisible by the tensor-parallel world size {n}"
        in (job["odd_sequence_error"])
    )
