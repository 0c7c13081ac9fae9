"""ddp_course.tools.flops: peaks by exact device name, the model FLOPs per token, MFU."""

import pytest

from ddp_course.tools import flops


@pytest.mark.parametrize("name", sorted(flops.PEAK_BF16_FLOPS))
def test_every_known_name_gets_its_own_peak(name):
    # The exact name torch.cuda.get_device_name() reports, surrounding spaces ignored.
    assert flops.peak_bf16_flops(f" {name} ") == flops.PEAK_BF16_FLOPS[name]
    assert flops.skip_reason(name, "bfloat16") is None


def test_cards_that_share_a_substring_get_different_peaks():
    # A substring lookup gave the PCIe and NVL cards the SXM's peak, the L40S the L4's.
    assert flops.peak_bf16_flops("NVIDIA H100 PCIe") < flops.peak_bf16_flops("NVIDIA H100 NVL")
    assert flops.peak_bf16_flops("NVIDIA H100 NVL") < flops.peak_bf16_flops("NVIDIA H100 80GB HBM3")
    assert flops.peak_bf16_flops("NVIDIA L40S") == pytest.approx(3 * 120.7e12, rel=0.01)
    # Dense peaks, half the data sheets' "with sparsity" figures (flops.py cites them).
    assert flops.peak_bf16_flops("NVIDIA H100 80GB HBM3") == pytest.approx(1979e12 / 2, rel=1e-3)
    assert flops.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA RTX A1000",
        "NVIDIA RTX A1000 6GB Laptop GPU",
        "H100",
        "NVIDIA A10G",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA L40S-48C",
        "NVIDIA GH200 480GB",
        "",
    ],
)
def test_an_unknown_or_partial_name_has_no_peak(name):
    assert flops.peak_bf16_flops(name) is None


def test_skip_reasons_name_what_is_missing():
    assert flops.skip_reason("NVIDIA RTX A1000", "bfloat16") == (
        "MFU skipped: no peak known for NVIDIA RTX A1000 (give it with --peak-flops)"
    )
    assert flops.skip_reason("NVIDIA RTX A1000", "bfloat16", peak_flops=1e14) is None
    assert "CPU" in flops.skip_reason("", "bfloat16", peak_flops=1e14)
    assert "CPU" in flops.skip_reason("", "bfloat16")
    assert "float32" in flops.skip_reason("NVIDIA H100 80GB HBM3", "float32")


def test_flops_per_token_and_mfu():
    # 6 N + 12 L d T: N = 1000, L = 2, d = 8, T = 4 -> 6000 + 768.
    assert flops.flops_per_token(1000, 2, 8, 4) == 6768
    assert flops.mfu(6768, 1e6, 6768e6) == pytest.approx(1.0)
    assert flops.mfu(6768, 0.5e6, 6768e6) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        flops.mfu(1, 1, 0)
    with pytest.raises(ValueError, match="negative"):
        flops.flops_per_token(-1, 2, 8, 4)


def test_matmul_params_leave_out_the_embedding_tables():
    from ddp_course.models import TinyGPT

    d, L, V, T = 16, 2, 256, 16
    model = TinyGPT(d_model=d, n_heads=4, n_layers=L, seq_len=T)
    # Everything but the token (V x d) and position (T x d) tables: blocks, ln_f, head.
    assert flops.matmul_params(model) == L * (12 * d * d + 13 * d) + 2 * d + V * d
    total = sum(p.numel() for p in model.parameters())
    assert flops.matmul_params(model) == total - V * d - T * d
