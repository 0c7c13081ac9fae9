"""Lesson 14's script under torchrun on 2 gloo ranks with a tiny model: the saved bytes of
every checkpointing policy equal the prediction, gradients equal those without
checkpointing, recomputation shows as extra FLOPs (none for selective checkpointing), and
FSDP2's mixed-precision states on each rank equal the formula. The notebook runs the
script as a plain process; tests/unit/test_activation_*.py check the pieces."""

from ddp_course import activation_memory as am
from ddp_course.harness import launch


def test_memory_script_on_two_ranks(root):
    args = ["--seq-len", "16", "--batch-size", "2", "--d-model", "32", "--n-layers", "3",
            "--steps", "1"]  # fmt: skip
    r = launch.torchrun(root / "scripts/14_memory.py", args, nproc=2, results=True,
                        echo=False, timeout_s=240).results  # fmt: skip
    assert r["world_size"] == 2
    rows = {row["policy"]: row for row in r["rows"]}
    assert list(rows) == list(am.POLICIES)
    for row in rows.values():
        assert row["measured_bytes"] == row["predicted_bytes"], row
        assert row["grads_equal_none"], row
    held = {p: rows[p]["measured_bytes"] for p in rows}
    assert held["every_block"] < held["every_submodule"] < held["every_other_block"]
    assert held["every_other_block"] < held["none"] and held["selective"] < held["none"]
    flops = {p: rows[p]["flops"] for p in rows}
    assert flops["selective"] == flops["none"] < flops["every_other_block"] < flops["every_block"]
    assert flops["every_submodule"] == flops["every_block"]
    for rank in r["fsdp"]:
        measured = {k: v for k, v in rank["measured"].items() if k in rank["formula"]}
        assert measured == rank["formula"], rank
        assert rank["measured"]["gathered_dtypes"] == ["torch.bfloat16"]
        assert rank["measured"]["gradient_dtypes"] == ["torch.float32"]
