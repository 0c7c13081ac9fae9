"""Lessons 13 and 14 on a GPU: the plain-python runs (a group of one on nccl, so CUDA even
with one GPU) of ``13_gpt.py`` (float32 against DDP with --check; bfloat16 mixed precision
with tokens/s and the MFU, or the reason it is skipped) and of ``14_memory.py`` (for every
checkpointing policy, the bytes the CUDA allocator holds when forward returns within 5% of the
predicted activations, and its peak within the bound the lesson predicts); with
4 GPUs, lesson 13's 4-rank suite on nccl. A few seconds each, the suite longer.
"""

import pytest
from gpu_support import keep, needs_4_gpus, needs_gpu, run, run_plain

from ddp_course import step_budget
from ddp_course.tools import flops

pytestmark = pytest.mark.serial

TINY = ["--d-model", "16", "--seq-len", "16"]


@needs_gpu
def test_gpt_plain_run_matches_ddp_on_a_gpu(root):
    r = run_plain(root, "13_gpt.py", ["--steps", "3", "--check", "--sample", "8", *TINY])
    keep("13_gpt_check", r)
    assert r["meta"]["device"].startswith("cuda") and r["meta"]["backend"] == "nccl"
    assert r["gpu"] and r["master_dtypes"] == ["torch.float32"]
    # FSDP2 over one GPU against DDP over one GPU, float32 with TF32 off: the same sums,
    # though cuBLAS may pick other kernels for FSDP2's gathered copies of the weights.
    assert r["losses"] == pytest.approx(r["ddp_losses"], rel=1e-5)
    assert r["param_gap"] <= 1e-4
    assert len(r["sample"]) == len("ROMEO:") + 8  # the prompt and --sample 8 new bytes


@needs_gpu
def test_gpt_bfloat16_records_tokens_per_s_and_mfu(root):
    args = [
        "--dtype",
        "bfloat16",
        "--steps",
        "30",
        "--warmup",
        "10",
        "--sample",
        "0",
        "--d-model",
        "128",
        "--seq-len",
        "128",
        "--batch-size",
        "16",
    ]
    r = run_plain(root, "13_gpt.py", args)
    keep(
        "13_gpt_bf16",
        {
            k: r.get(k)
            for k in (
                "meta",
                "gpu",
                "tokens_per_s",
                "median_step_s",
                "mfu",
                "mfu_skipped",
                "flops_per_token",
                "timed_steps",
                "master_dtypes",
            )
        },
    )
    assert r["master_dtypes"] == ["torch.float32"]  # float32 master weights
    assert r["head_output_dtypes"] == ["torch.bfloat16"]  # bfloat16 compute
    assert r["timed_steps"] == 20 and r["tokens_per_s"] > 0
    if flops.peak_bf16_flops(r["gpu"]) is None:
        assert r["mfu_skipped"] == flops.skip_reason(r["gpu"], "bfloat16")
    else:
        assert 0 < r["mfu"] < 1, r["mfu"]


@needs_gpu
def test_memory_cuda_peak_within_the_predicted_bound(root):
    # The 5% comparison is made when forward returns: the allocator then holds the saved
    # storages (the hooks count each whole storage: equal on a CPU for every policy), SAC's
    # cached outputs and the loss, each rounded up to 512 B, so it exceeds the prediction by
    # at most 512 B per tensor (under 3.1% at the default shapes), once the token ids and
    # targets are taken out: forward saves them, but they were allocated before it began.
    # The peak is not compared at 5% with cuda_predicted_bytes: that sums every gradient
    # and the recomputed region on top of every activation, which never coexist (23% to
    # 78% above the peak's lower end here); the peak is checked against the bound
    # [low, high] instead.
    r = run_plain(root, "14_memory.py", ["--steps", "1"])  # the script raises outside the bound
    rows = {row["policy"]: row for row in r["rows"]}
    keep("14_memory_cuda_peak", {"meta": r["meta"], "rows": r["rows"]})
    assert r["device"].startswith("cuda")
    for policy, row in rows.items():
        assert row["measured_bytes"] == row["predicted_bytes"], policy
        assert row["grads_equal_none"], policy
        made = row["predicted_bytes"] - row["cuda_forward_inputs_bytes"]
        extra = row["cuda_forward_bytes"] - made
        assert 0 <= extra <= step_budget.ALLOCATOR_BLOCK * row["cuda_forward_tensors"], row
        assert extra <= 0.05 * made, row
        assert row["cuda_low_bytes"] <= row["cuda_peak_bytes"] <= row["cuda_high_bytes"], row
    assert rows["every_block"]["cuda_peak_bytes"] < rows["none"]["cuda_peak_bytes"]


@needs_4_gpus
def test_gpt_suite_on_four_gpus(root, tmp_path):
    r = run(
        root,
        "13_gpt.py",
        ["--suite", "--dtype", "float64", "--steps", "5", "--checkpoint", str(tmp_path / "dcp")],
        nproc=4,
    )
    keep(
        "13_gpt_suite",
        {"meta": r["meta"], "gaps_by_rank": r["gaps_by_rank"], "checkpoint": r["checkpoint"]},
    )
    assert r["meta"]["backend"] == "nccl"
    for gaps in r["gaps_by_rank"]:
        assert all(g <= 1e-10 for g in gaps.values()), gaps
    for row in r["memory"]:
        assert row["held"] == row["formula"], row
    for key, c in r["counts"].items():
        assert c["measured"] == c["formula"], key
    for where in ("4x1", "one process"):
        assert r["checkpoint"][where]["gap"] <= 1e-10
