"""Model FLOPs and MFU: how much of a GPU's dense bfloat16 peak a training run uses.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM", appendix B) is the
FLOP/s a run would need to do the *model's* arithmetic at its measured tokens/s,
divided by the device's peak. For a decoder-only Transformer, PaLM counts per
token ``6 N + 12 L d T`` FLOPs for forward and backward: ``6 N`` for the matmuls
of the ``N`` parameters that multiply (2 in forward, 4 in backward), and
``12 L d T`` for attention's ``[T, T]`` products (``L`` layers, width ``d``,
``T`` tokens per sequence). Embedding lookups multiply nothing, so ``N``
excludes the token and position embeddings. Recomputation (activation
checkpointing) is not model work and is not counted.

The peaks are exact device names as ``torch.cuda.get_device_name()`` reports
them, mapped to the dense bfloat16 Tensor Core figure of NVIDIA's data sheet
(the data sheets also print twice that, "with sparsity"; a dense matmul never
reaches it). A name that is not in the table has no known peak: MFU is skipped
rather than computed against the wrong card's peak (an ``"H100"`` substring
matches the SXM, PCIe and NVL cards, whose peaks differ by a third).
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "PEAK_BF16_FLOPS",
    "flops_per_token",
    "matmul_params",
    "mfu",
    "peak_bf16_flops",
    "skip_reason",
]

# Dense bfloat16 Tensor Core peak, FLOP/s, per device name; each figure is half the
# "with sparsity" one of the NVIDIA data sheet named beside it.
PEAK_BF16_FLOPS: dict[str, float] = {
    # NVIDIA H100 Tensor Core GPU data sheet (SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOPS
    # with sparsity): https://www.nvidia.com/en-us/data-center/h100/
    "NVIDIA H100 80GB HBM3": 989.4e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    # NVIDIA H200 data sheet (H200 SXM 1,979 / H200 NVL 1,671 TFLOPS with sparsity):
    # https://www.nvidia.com/en-us/data-center/h200/
    "NVIDIA H200": 989.4e12,
    "NVIDIA H200 NVL": 835.5e12,
    # NVIDIA A100 Tensor Core GPU data sheet (every A100: 312 TFLOPS dense, 624 sparse):
    # https://www.nvidia.com/en-us/data-center/a100/
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    # NVIDIA L4 data sheet (242 TFLOPS with sparsity):
    # https://www.nvidia.com/en-us/data-center/l4/
    "NVIDIA L4": 121e12,
    # NVIDIA L40S data sheet (362.05 dense, 733 with sparsity):
    # https://www.nvidia.com/en-us/data-center/l40s/
    "NVIDIA L40S": 362.05e12,
    # NVIDIA L40 data sheet (181.05 dense, 362.1 with sparsity):
    # https://www.nvidia.com/en-us/data-center/l40/
    "NVIDIA L40": 181.05e12,
    # NVIDIA A10 data sheet (125 dense, 250 with sparsity):
    # https://www.nvidia.com/en-us/data-center/products/a10-gpu/
    "NVIDIA A10": 125e12,
}


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bfloat16 peak of the GPU called ``device_name``, FLOP/s; ``None`` if unknown.

    Args:
        device_name: exactly what ``torch.cuda.get_device_name(device)`` returns
            (surrounding spaces are ignored; nothing else is: ``"H100"`` alone is unknown).
    """
    return PEAK_BF16_FLOPS.get(device_name.strip())


def skip_reason(device_name: str, dtype: str, peak_flops: float | None = None) -> str | None:
    """Why no MFU is reported for a run of ``dtype`` on ``device_name``; ``None`` if it can be.

    Args:
        device_name: ``torch.cuda.get_device_name()``, or ``""`` for a run on a CPU.
        dtype: the run's compute dtype by name (``"bfloat16"``, ``"float32"``, ...): the
            peaks are bfloat16 ones, so only a bfloat16 run is compared with them.
        peak_flops: the GPU's dense bfloat16 peak given by hand (a script's
            ``--peak-flops``), FLOP/s; ``None``: looked up in :data:`PEAK_BF16_FLOPS`.
    """
    if not device_name:
        return "MFU skipped: a CPU run has no GPU peak to compare with"
    if dtype != "bfloat16":
        return f"MFU skipped: the peaks are bfloat16 ones, and this run computes in {dtype}"
    if peak_flops is None and peak_bf16_flops(device_name) is None:
        return f"MFU skipped: no peak known for {device_name} (give it with --peak-flops)"
    return None


def matmul_params(model: nn.Module) -> int:
    """``N`` of :func:`flops_per_token`: the parameters of ``model`` outside embedding tables.

    An ``nn.Embedding`` looks rows up and multiplies nothing, so its weight is left out
    (PaLM, appendix B, counts non-embedding parameters); every other parameter counts
    once, even where it is used twice.

    Returns:
        A number of parameters (elements).
    """
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedded)


def flops_per_token(params: int, n_layers: int, d_model: int, seq_len: int) -> int:
    """Model FLOPs of forward and backward per token, ``6 N + 12 L d T`` (PaLM, appendix B).

    Args:
        params: ``N``, the parameters that multiply: all but embedding tables.
        n_layers, d_model, seq_len: ``L``, ``d`` and ``T`` (tokens per sequence).

    Raises:
        ValueError: a negative count.
    """
    if min(params, n_layers, d_model, seq_len) < 0:
        raise ValueError("parameter, layer, width and length counts must not be negative")
    return 6 * params + 12 * n_layers * d_model * seq_len


def mfu(flops_per_token: float, tokens_per_s_per_gpu: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``flops_per_token * tokens/s per GPU / peak``, a fraction.

    Args:
        flops_per_token: :func:`flops_per_token` of the model.
        tokens_per_s_per_gpu: the job's tokens per second divided by its number of GPUs
            (each GPU does its share of every token's model FLOPs).
        peak_flops: the GPU's peak, FLOP/s (:func:`peak_bf16_flops`).

    Raises:
        ValueError: a peak that is not positive.
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, not {peak_flops}")
    return flops_per_token * tokens_per_s_per_gpu / peak_flops
