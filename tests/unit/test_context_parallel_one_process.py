"""Context parallelism's one-process pieces: placement, masks, the log-sum-exp merge, blockwise
attention against scaled_dot_product_attention, the ring schedule's work per rank, formulas."""

import pytest
import torch
from torch.nn import functional as F

from ddp_course import context_parallel as cp


def qkv(t=12, dtype=torch.float64, b=2, h=3, d=4):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, t, d, generator=gen, dtype=dtype) for _ in range(3)]


def test_layouts_cover_the_sequence_once():
    for layout in cp.LAYOUTS:
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
                rtol=1e-12, atol=1e-12,
            )  # fmt: skip


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
        alone = F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx],
                                               is_causal=True)  # fmt: skip
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
    assert cp.ring_bytes((1, 2, 3, 4), 4, 4) == 2 * 3 * 24 * 4
    assert cp.ulysses_bytes((1, 2, 3, 4), 4, 4) == 4 * 3 * 24 * 4 // 4
