"""Lesson 13's real run in bfloat16 and its clock, as one plain process on the CPU (a gloo
group of one; FSDP2 still wraps the model): --dtype bfloat16 computes in bfloat16 through
FSDP2's MixedPrecisionPolicy while the weights the optimizer updates stay float32, and
tokens/s counts only the steps after --warmup. tests/gpu/test_gpu_lesson13_14.py runs the
same on a GPU, where the MFU is recorded too."""

import pathlib

import pytest

from ddp_course.harness import launch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "13_gpt.py"

TINY = ["--d-model", "16", "--seq-len", "16", "--batch-size", "2", "--sample", "0"]


@pytest.fixture(scope="module")
def bf16():
    return launch.python(
        SCRIPT,
        ["--dtype", "bfloat16", "--steps", "3", "--warmup", "1", *TINY],
        results=True,
        echo=False,
        timeout_s=300,
    ).results


def test_bfloat16_keeps_float32_master_weights(bf16):
    assert bf16["master_dtypes"] == ["torch.float32"]  # a cast model would hold bfloat16
    assert bf16["head_output_dtypes"] == ["torch.bfloat16"]  # and the compute is bfloat16
    assert bf16["losses"][-1] < bf16["losses"][0]


def test_only_the_steps_after_warmup_are_timed(bf16):
    # Each step is timed on its own (set-up before the first is not); tokens/s comes from
    # the steps after the first --warmup ones only.
    assert len(bf16["step_seconds"]) == 3 and min(bf16["step_seconds"]) > 0
    assert bf16["warmup_steps"] == 1 and bf16["timed_steps"] == 2
    assert bf16["seconds"] == pytest.approx(sum(bf16["step_seconds"][1:]), rel=1e-12)
    want = 2 * 2 * 16 / bf16["seconds"]  # timed steps x sequences x tokens / seconds
    assert bf16["tokens_per_s"] == pytest.approx(want, rel=1e-12)
    assert bf16["mfu_skipped"] == "MFU skipped: a CPU run has no GPU peak to compare with"


def test_no_tokens_per_s_when_every_step_is_warm_up():
    r = launch.python(
        SCRIPT, ["--steps", "2", "--warmup", "2", *TINY], results=True, echo=False, timeout_s=300
    ).results
    assert r["tokens_per_s"] is None and r["seconds"] is None and len(r["step_seconds"]) == 2
    assert r["tokens_per_s_skipped"] == "2 steps leave none after --warmup 2"
    assert r["master_dtypes"] == ["torch.float32"]
    assert r["head_output_dtypes"] == ["torch.float32"]
