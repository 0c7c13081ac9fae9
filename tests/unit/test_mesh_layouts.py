"""ddp_course.mesh_layouts in one process: layouts, mesh groups (8 ranks checked against
DeviceMesh on PyTorch's fake process group), pipeline stages, the memory and collective
formulas on hand-counted cases, the token-count loss, MFU."""

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional

from ddp_course import mesh_layouts as ml
from ddp_course import mesh_predictions as predict
from ddp_course.mesh_model import split_stages, token_mean_loss
from ddp_course.models import TinyGPT

TINY = dict(d_model=16, n_heads=4, n_layers=2, seq_len=16)


def test_layouts_need_pp_dp_tp_ranks():
    assert {n: ml.layout(n).world_size for n in ml.LAYOUTS} == dict.fromkeys(ml.LAYOUTS, 4)
    with pytest.raises(ValueError, match="needs 4 ranks"):
        ml.layout("fsdp x tp", 2)
    with pytest.raises(ValueError, match="tp > 1"):
        ml.Layout("x", dp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="does not divide"):
        ml.Layout("x", dp=3, data="hsdp", replicate=2)
    assert ml.layout("hsdp").shape == (1, 2, 2, 1)
    assert ml.layout("ddp").shape == (1, 4, 1, 1)


def test_a_layout_refuses_a_model_it_cannot_split():
    # 13_gpt.py calls check_model with --n-heads, --d-model and --seq-len before building.
    ml.Layout("x", tp=4).check_model(8, 64, 64)
    with pytest.raises(ValueError, match="tp=4 does not divide the 2 attention heads"):
        ml.Layout("x", tp=4).check_model(2, 64, 64)
    with pytest.raises(ValueError, match="do not divide d_model"):
        ml.Layout("x", tp=2).check_model(6, 64, 64)
    with pytest.raises(ValueError, match="seq_len=6"):
        ml.Layout("x", tp=4, sequence_parallel=True).check_model(4, 64, 6)


def test_mesh_groups_of_a_3d_layout():
    g = ml.mesh_groups((2, 2, 2), ("pp", "dp", "tp"))
    # Written out by hand: tp peers are neighbours, dp peers 2 apart, pp peers 4 apart.
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError):
        ml.mesh_groups((2, 2), ("pp",))


def test_mesh_groups_equal_device_mesh_on_8_fake_ranks():
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    names = ("pp", "dp", "tp")
    want = ml.mesh_groups((2, 2, 2), names)
    for rank in range(8):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=8)
        try:
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
            for d in names:
                ranks = dist.get_process_group_ranks(mesh[d].get_group())
                assert rank in ranks and ranks in want[d], (rank, d)
        finally:
            dist.destroy_process_group()


def test_stages_compose_to_the_whole_model():
    torch.manual_seed(0)
    model = TinyGPT(**{**TINY, "n_layers": 4}).double()
    x = torch.randint(0, 256, (2, 16))
    stages = split_stages(model, 2)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="must divide"):
        split_stages(model, 3)


def test_memory_formula_on_hand_counted_layouts():
    model = TinyGPT(**TINY)
    whole = sum(p.numel() for p in model.parameters())
    assert predict.expected_memory_bytes(model, ml.layout("ddp"), 8)["params"] == 8 * whole
    assert predict.expected_memory_bytes(model, ml.layout("fsdp"), 8)["grads"] == 8 * whole // 4
    d, v, t = 16, 256, 16
    # TP keeps whole: embeddings, LayerNorms (2 per block + final), proj and fc2 biases.
    kept = v * d + t * d + 2 * (2 * 2 * d + d + d) + 2 * d
    assert predict.expected_memory_bytes(model, ml.layout("tp"), 4)["optimizer"] == 2 * 4 * (
        kept + (whole - kept) // 4
    )


def test_collective_formula_on_the_2_block_model():
    counts = predict.expected_collectives(ml.layout("fsdp x tp"), 2)
    # 3 FSDP units (2 blocks + root): gathered for forward; the blocks again for backward
    # (the root stays gathered: PyTorch's default for the root).
    assert counts["forward"] == {"all_gather shard": 3, "all_reduce tp": 4}
    assert counts["backward"] == {
        "all_gather shard": 2,
        "reduce_scatter shard": 3,
        "all_reduce tp": 9,
    }
    kept = predict.expected_collectives(ml.layout("fsdp x tp"), 2, reshard_after_forward=False)
    assert "all_gather shard" not in kept["backward"]
    # DDP: one all-reduce per gradient bucket over replicate, and the second step starts
    # with the rebuilt bucket order broadcast; HSDP: one all-reduce per unit.
    assert predict.expected_collectives(ml.layout("ddp"), 2) == {
        "forward": {"broadcast replicate": 2},
        "backward": {"all_reduce replicate": 1},
        "loss": {},
    }
    later = predict.expected_collectives(ml.layout("ddp"), 2, rebuilt_buckets=False)
    assert later["forward"] == {}
    hsdp = predict.expected_collectives(ml.layout("hsdp"), 2)["backward"]
    assert hsdp == {"all_gather shard": 2, "reduce_scatter shard": 3, "all_reduce replicate": 3}
    # The pipeline: one phase; each block gathered per micro-batch and once in backward;
    # per micro-batch one send and one receive per neighbouring stage.
    pp = predict.expected_collectives(ml.layout("pp x fsdp"), 2, microbatches=2)
    assert pp == {
        "step": {
            "all_gather shard": 4,
            "reduce_scatter shard": 2,
            "all_reduce pp": 1,
            "all_reduce shard": 1,
            "send pp": 2,
            "recv pp": 2,
        }
    }
    middle = predict.expected_collectives(ml.Layout("x", pp=4, dp=1), 4, microbatches=3, stage=1)
    assert middle["step"]["send pp"] == middle["step"]["recv pp"] == 6
    # pp x tp: the tp all-reduces per micro-batch; the last stage gathers its logits
    # (no vocabulary-parallel loss inside a pipeline). Measured on 4 gloo ranks by
    # tests/multiprocess/test_gpt_layouts.py.
    pp_tp = ml.Layout("x", pp=2, tp=2)
    first = predict.expected_collectives(pp_tp, 2, microbatches=2, stage=0)["step"]
    last = predict.expected_collectives(pp_tp, 2, microbatches=2, stage=1)["step"]
    assert first == {"all_reduce pp": 1, "send pp": 2, "recv pp": 2, "all_reduce tp": 12}
    assert last == {**first, "all_reduce tp": 14, "all_gather tp": 2}
    with pytest.raises(ValueError, match="no sp"):
        predict.expected_collectives(ml.Layout("x", pp=2, tp=2, sequence_parallel=True), 2)
    with pytest.raises(ValueError, match="no sp"):
        predict.expected_collectives(ml.Layout("x", pp=2, dp=2, data="ddp"), 2)


def test_token_mean_loss_in_one_process_is_the_mean_over_real_tokens():
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    y = torch.randint(0, 7, (3, 5))
    y[0, 2:] = -100
    want = functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(token_mean_loss(logits, y, None), want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="no token"):
        token_mean_loss(logits, torch.full_like(y, -100), None)


def test_token_mean_loss_wants_the_data_parallel_group():
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    logits, y = torch.randn(1, 2, 7), torch.randint(0, 7, (1, 2))
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="data-parallel group"):
            token_mean_loss(logits, y, None)  # the default group would be the world
        token_mean_loss(logits, y, dist.group.WORLD)  # named: accepted
    finally:
        dist.destroy_process_group()


def test_stages_keep_the_embeddings_dropout():
    torch.manual_seed(0)
    model = TinyGPT(**{**TINY, "n_layers": 4, "dropout": 0.3}).double()
    x = torch.randint(0, 256, (2, 16))
    stages = split_stages(model, 2)
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    torch.testing.assert_close(stages[1](stages[0](x)), want, rtol=0, atol=0)
