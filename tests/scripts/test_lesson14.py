"""Lesson 14's script under torchrun on 2 gloo ranks with a tiny model: the saved bytes of
every checkpointing policy equal the prediction, gradients equal those without
checkpointing, recomputation shows as extra FLOPs (none for op-level SAC, whose cost is
time), the attention core's recomputation keeps less than op-level SAC and every Linear
saves nothing, and FSDP2's mixed-precision states on each rank equal the per-parameter
formula at 3 ranks (where torch.chunk splits the rows unevenly and the all-gather pads
them), and FSDP2 with activation checkpointing in every place takes one all-gather per unit
in forward and per block in backward (none added by the recomputation), while a checkpoint
around the whole model holds every block's full weights at once in backward. The notebook
runs the script under torchrun;
tests/unit/test_activation_*.py check the pieces."""

from ddp_course import recompute_policies
from ddp_course.harness import launch


def test_memory_script_on_three_ranks(root):
    # 3 ranks: torch.chunk splits 32 rows into 11, 11 and 10 (256 into 86, 86 and 84), so
    # the ranks hold different amounts and the all-gathers pad.
    args = [
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--d-model",
        "32",
        "--n-layers",
        "3",
        "--steps",
        "1",
    ]
    r = launch.torchrun(
        root / "scripts/14_memory.py", args, nproc=3, results=True, echo=False, timeout_s=240
    ).results
    assert r["world_size"] == 3
    rows = {row["policy"]: row for row in r["rows"]}
    assert list(rows) == list(recompute_policies.POLICIES)
    for row in rows.values():
        assert row["measured_bytes"] == row["predicted_bytes"], row
        assert row["grads_equal_none"], row
    held = {p: rows[p]["measured_bytes"] for p in rows}
    assert held["every_block"] < held["every_submodule"] < held["every_other_block"]
    assert held["every_other_block"] < held["none"] and held["op_sac"] < held["none"]
    assert held["core_attention"] < held["none"] and held["every_linear"] == held["none"]
    flops = {p: rows[p]["flops"] for p in rows}
    assert flops["op_sac"] == flops["none"] < flops["every_other_block"] < flops["every_block"]
    assert flops["every_submodule"] == flops["every_block"]
    assert flops["none"] < flops["core_attention"] < flops["every_linear"] < flops["every_block"]
    assert all(row["threads"] == 1 for row in rows.values())  # torchrun's OMP_NUM_THREADS
    assert len({rank["measured"]["sharded_parameters"] for rank in r["fsdp"]}) == 2  # 11, 11, 10
    for rank in r["fsdp"]:
        measured = {k: v for k, v in rank["measured"].items() if k in rank["formula"]}
        assert measured == rank["formula"], rank
        assert rank["measured"]["gathered_dtypes"] == ["torch.bfloat16"]
        assert rank["measured"]["gradient_dtypes"] == ["torch.float32"]
    ac = r["fsdp_ac"]
    run = {(row["order"], row["reshard_after_forward"]): row for row in ac["rows"]}
    assert list(run) == [
        ("no_ac", None),
        ("ac_then_fsdp", None),
        ("fsdp_then_ac", None),
        ("ac_around_root", None),
        ("no_ac", False),
    ]
    for row in ac["rows"]:  # 3 blocks and the root
        assert row["forward_all_gathers"] == row["reduce_scatters"] == 4, row
        assert row["backward_all_gathers"] == (3 if row["reshard_after_forward"] is None else 0)
        assert row["compared_with"] == "one process" or row["max_gap"] == 0.0, row
    held = {k: row["full_weights_in_backward"] for k, row in run.items()}
    per_block = ac["root_bytes"] + ac["block_bytes"]
    assert held[("no_ac", None)] == held[("ac_then_fsdp", None)] == per_block
    assert held[("fsdp_then_ac", None)] == per_block
    assert held[("ac_around_root", None)] == held[("no_ac", False)] == ac["model_bytes"]
    assert run[("ac_around_root", None)]["backward_order"] == "AG AG AG RS RS RS RS"
    flops = {k: row["backward_flops"] for k, row in run.items()}
    assert flops[("no_ac", None)] < flops[("ac_then_fsdp", None)] == flops[("fsdp_then_ac", None)]
