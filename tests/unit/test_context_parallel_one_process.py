"""Context parallelism's one-process pieces: placement, masks, the log-sum-exp merge, blockwise
attention against scaled_dot_product_attention, the ring schedule's work per rank, formulas."""

import importlib

import pytest
import torch
from torch.nn import functional as F

from ddp_course import context_parallel as cp


def qkv(t=12, dtype=torch.float64, b=2, h=3, d=4):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, t, d, generator=gen, dtype=dtype) for _ in range(3)]


def test_layouts_cover_the_sequence_once():
    for layout in cp.PLACEMENTS:
        for p in (1, 2, 3, 4):
            pos = torch.cat([cp.sequence_positions(r, p, 4, layout) for r in range(p)])
            assert sorted(pos.tolist()) == list(range(4 * p))
    assert cp.sequence_positions(0, 2, 4, "zigzag").tolist() == [0, 1, 6, 7]
    assert cp.sequence_positions(1, 2, 4, "zigzag").tolist() == [2, 3, 4, 5]


def test_bad_placements_raise():
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.sequence_segments(0, 2, 4, "striped")
    with pytest.raises(ValueError, match="even number"):
        cp.sequence_segments(0, 2, 3, "zigzag")
    with pytest.raises(ValueError, match="not divisible by 5 ranks"):
        cp.shard_sequence(torch.zeros(1, 1, 12, 2), 0, 5)


def test_merge_of_blocks_equals_sdpa():
    q, k, v = qkv()
    for chunks in (1, 2, 3, 4, 6):
        for causal in (True, False):
            torch.testing.assert_close(
                cp.blockwise_attention(q, k, v, chunks, causal),
                F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                rtol=1e-12,
                atol=1e-12,
            )


def test_merge_without_the_correction_is_wrong():
    q, k, v = qkv()
    o1, l1 = cp.block_attention(q, k[:, :, :6], v[:, :, :6], None)
    o2, l2 = cp.block_attention(q, k[:, :, 6:], v[:, :, 6:], None)
    whole = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(cp.merge_partials(o1, l1, o2, l2)[0], whole)
    assert not torch.allclose(o1 + o2, whole) and not torch.allclose((o1 + o2) / 2, whole)


def test_rows_that_see_nothing_stay_zero_and_merge_cleanly():
    q, k, v = qkv(t=4)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2:, :] = True
    o, lse = cp.block_attention(q, k, v, mask)
    assert torch.isinf(lse[..., :2]).all() and (o[..., :2, :] == 0).all()
    out, lse2 = cp.merge_partials(o, lse, o, lse)
    assert torch.isfinite(out).all() and (out[..., :2, :] == 0).all()


def test_document_mask_equals_per_document_attention():
    q, k, v = qkv(t=10)
    docs = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    got = cp.reference_attention(q, k, v, causal=True, document_ids=docs)
    for d in range(3):
        idx = (docs == d).nonzero().flatten()
        alone = F.scaled_dot_product_attention(
            q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True
        )
        torch.testing.assert_close(got[:, :, idx], alone, rtol=1e-12, atol=1e-12)


def test_ring_schedule_work_contiguous_vs_zigzag():
    for p in (2, 3, 4):
        t = 8
        cont, zig = cp.ring_work(p, t, "contiguous"), cp.ring_work(p, t, "zigzag")
        assert [w["blocks"] for w in cont] == list(range(1, p + 1))
        assert len({w["visible"] for w in zig}) == 1
        ratio = max(w["visible"] for w in cont) / min(w["visible"] for w in cont)
        # 1 + 2(P-1) T/(T+1): close to 2P-1 for long chunks.
        assert ratio == pytest.approx(1 + 2 * (p - 1) * t / (t + 1))
    total = sum(w["visible"] for w in cp.ring_work(3, 8, "zigzag"))
    assert total == 24 * 25 // 2  # the whole causal triangle, once


def test_byte_formulas():
    assert cp.ring_attention_bytes((1, 2, 3, 4), 4, 4) == 2 * 3 * 24 * 4
    assert cp.ulysses_bytes((1, 2, 3, 4), 4, 4) == 4 * 3 * 24 * 4 // 4


def test_step_work_and_load_balance():
    # Contiguous, causal, P = 4, T/P = 16: rank r computes a triangle at step 0 and full
    # blocks at steps 1..r, nothing after.
    p, t = 4, 16
    tri = t * (t + 1) // 2
    grid = cp.ring_step_work(p, t)
    assert grid == [[tri] + [t * t] * r + [0] * (p - 1 - r) for r in range(p)]
    assert [sum(row) for row in grid] == [w["visible"] for w in cp.ring_work(p, t)]
    lb = cp.load_balance(grid)
    mean = (p * t) * (p * t + 1) / 2 / p  # the whole causal triangle, shared out
    assert lb["busiest_over_mean"] == pytest.approx(((p - 1) * t * t + tri) / mean)
    assert lb["busiest_over_mean"] < (2 * p - 1) / p < lb["busiest_over_idlest"]
    # Every step has a rank with a full block: the lockstep bound is the busiest rank.
    assert lb["lockstep_over_mean"] == pytest.approx(lb["busiest_over_mean"])
    zig = cp.load_balance(cp.ring_step_work(p, t, "zigzag"))
    assert zig == {"busiest_over_idlest": 1.0, "busiest_over_mean": 1.0, "lockstep_over_mean": 1.0}
    docs = torch.arange(p * t) // 8  # documents inside chunks: ranks idle after step 0
    assert cp.load_balance(cp.ring_step_work(p, t, document_ids=docs))["busiest_over_mean"] == 1


def test_backward_byte_formula():
    # K, V: P-1 passes of 2 bytes (bfloat16); dK, dV: P passes of 4 (float32 accumulators).
    assert cp.ring_backward_bytes((1, 2, 3, 4), 2, 4, 4) == 2 * 3 * 24 * 2 + 2 * 4 * 24 * 4
    assert cp.ring_backward_bytes((1, 2, 3, 4), 4, 4) == (4 * 4 - 2) * 24 * 4
    assert cp.ring_backward_bytes((1, 2, 3, 4), 4, 1) == 0  # one rank: no pass
    assert cp.ulysses_backward_bytes((1, 2, 3, 4), 4, 4) == cp.ulysses_bytes((1, 2, 3, 4), 4, 4)


def test_the_package_lists_each_name_from_its_module():
    from ddp_course.context_parallel import cost, ring, ulysses

    assert cp.ulysses_attention is ulysses.ulysses_attention
    assert cp.ring_work is cost.ring_work
    assert cp.RingAttention is ring.RingAttention
    for name in set(cp.__all__) - {"PLACEMENTS"}:  # each defined in one of the package's modules
        assert getattr(cp, name).__module__.startswith("ddp_course.context_parallel."), name
    assert not hasattr(cp, "__getattr__")  # every name imported, none resolved late
    with pytest.raises(AttributeError):
        cp.nothing  # noqa: B018


def test_no_public_name_means_one_thing_here_and_another_elsewhere():
    # The ring's Tile, ring_attention_schedule, ring_attention_bytes and PLACEMENTS once
    # shared their names with models.Block, collectives.ring_schedule,
    # comm_cost.ring_bytes and mesh_layouts.LAYOUTS.
    for name in (
        "models",
        "collectives",
        "comm_cost",
        "mesh_layouts",
        "sequence_parallel",
        "tensor_parallel",
    ):
        module = importlib.import_module(f"ddp_course.{name}")
        assert not set(cp.__all__) & set(module.__all__), name


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_ops_see_every_block_of_the_schedule(group, layout):
    # One rank, zig-zag: two runs of 4 tokens, three blocks (the fourth is fully masked).
    calls = {"forward": 0, "backward": 0}

    def block(*a):
        calls["forward"] += 1
        return cp.block_attention(*a)

    def block_backward(*a):
        calls["backward"] += 1
        return cp.block_attention_backward(*a)

    q, k, v = (x.requires_grad_() for x in qkv(t=8))
    ops = cp.RingOps(block=block, block_backward=block_backward)
    out = cp.ring_attention(q, k, v, layout=layout, ops=ops)
    out.sum().backward()
    blocks = cp.ring_work(1, 8, layout)[0]["blocks"]
    assert calls == {"forward": blocks, "backward": blocks}
    assert blocks == (3 if layout == "zigzag" else 1)
    torch.testing.assert_close(out, cp.ring_attention(q, k, v, layout=layout), rtol=0, atol=0)


def test_gloo_scatter_fills_a_non_contiguous_buffer_in_memory_order(group):
    # Why torch's deprecated differentiable all_gather gets K, V gradients wrong on gloo:
    # its backward scatters contiguous copies into buffers made by torch.empty_like(grad),
    # which keep the gradient's strides, and gloo writes the bytes in memory order
    # (pytorch/pytorch#24836, #192920). SDPA's backward returns dK, dV laid out as
    # [B, T, H, D] in memory: with one head that is the logical order, with several not.
    import torch.distributed as dist

    sent = torch.arange(24.0).reshape(1, 2, 3, 4)  # [B, H, T, D], contiguous
    laid_out = torch.empty(1, 3, 2, 4).transpose(1, 2)  # [B, H, T, D] over [B, T, H, D]
    dist.scatter(laid_out, [sent], src=0)
    assert not torch.equal(laid_out, sent)
    assert torch.equal(laid_out.transpose(1, 2).flatten(), sent.flatten())  # memory order
    one_head = torch.empty(1, 3, 1, 4).transpose(1, 2)
    dist.scatter(one_head, [sent[:, :1]], src=0)
    assert torch.equal(one_head, sent[:, :1])  # one head: both orders agree
    q, k, v = (torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    seen = []
    k_used = k * 1
    k_used.register_hook(seen.append)  # the gradient as the gather's backward gets it
    F.scaled_dot_product_attention(q, k_used, v, attn_mask=torch.ones(4, 4).bool()).sum().backward()
    assert not seen[0].is_contiguous() and seen[0].transpose(1, 2).is_contiguous()
