"""The activations of one training step: the bytes saved for backward, predicted.

A training step holds four kinds of bytes: the parameters, their gradients, the
optimizer's state and the activations, the tensors that forward saves for
backward. This module predicts the activations per Transformer block term by
term (:func:`block_terms`, adapted from Korthikanti et al. 2022, section 4) and
for a whole model under each checkpointing policy (:func:`predict_activations`);
``ddp_course.tools.saved_tensors.SavedTensorCounter`` measures them on any device
with ``torch.autograd.graph.saved_tensors_hooks``. The whole step (state,
activations, the budget and the micro-batch that fits it) is
:mod:`ddp_course.step_budget`.

The model is :class:`ddp_course.models.TinyGPT`; its configuration is a dict
of TinyGPT's keyword arguments (``vocab_size``, ``d_model``, ``n_heads``,
``n_layers``, ``seq_len``, ``dropout``, ``flash``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from ddp_course.models import TinyGPT
from ddp_course.recompute_policies import POLICIES

__all__ = [
    "POLICIES",
    "Term",
    "block_bytes",
    "block_terms",
    "korthikanti_block_bytes",
    "model_config",
    "outside_terms",
    "parameter_count",
    "predict_activations",
]


@dataclasses.dataclass(frozen=True)
class Term:
    """One tensor saved for backward: what saves it, its size as a formula, its bytes.

    Attributes:
        name: the tensor (``"GELU input"``).
        saved_by: the operation whose backward needs it.
        formula: its bytes in s (sequence), b (batch), h (width), a (heads), V
            (vocabulary), e (bytes per element), m (bytes per dropout-mask element).
        bytes: the formula's value.
        region: ``"attention"`` or ``"mlp"`` (inside ``block.attn``/``block.mlp``)
            or ``"block"`` (the LayerNorms and the MLP's dropout, outside both).
        core: saved inside the attention core (QK^T, softmax, dropout, AV:
            ``CausalSelfAttention.attention_core``), what Korthikanti et al.'s
            selective recomputation drops.
    """

    name: str
    saved_by: str
    formula: str
    bytes: int
    region: str = "block"
    core: bool = False


def _check_shapes(batch: int, seq: int, d_model: int, n_heads: int) -> None:
    if min(batch, seq, d_model, n_heads) < 1:
        raise ValueError(f"sizes must be positive: batch={batch} seq={seq} d_model={d_model}")
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")


def block_terms(
    batch: int,
    seq: int,
    d_model: int,
    n_heads: int,
    *,
    element_bytes: int = 4,
    mask_bytes: int | None = None,
    dropout: bool = True,
    flash: bool = False,
    stats_bytes: int | None = None,
) -> list[Term]:
    """The tensors one :class:`~ddp_course.models.Block` saves for backward, term by term.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", section 4.1) count ``s b h (34 + 5 a s / h)`` bytes
    per block for 16-bit activations with 1-byte dropout masks: attention
    ``11 s b h + 5 a s^2 b`` (QKV input 2sbh, Q and K 4sbh, softmax output
    2as^2b, its dropout mask as^2b, dropout output 2as^2b, V 2sbh, projection
    input 2sbh, its dropout mask sbh), MLP ``19 s b h`` (fc1 input 2sbh, GELU
    input 8sbh, fc2 input 8sbh, dropout mask sbh) and the two LayerNorm inputs
    ``4 s b h``. The same terms here, with ``e`` bytes per element and ``m``
    per mask element, plus what the paper leaves out as small: each
    LayerNorm's mean and reciprocal standard deviation (``2 s b`` values of
    ``r`` bytes each) and the causal mask (``s^2`` bools) that ``masked_fill`` keeps.

    PyTorch's dropout on a CPU multiplies by a mask in the input's dtype, so
    ``m`` defaults to ``e``; a 1-byte mask is the paper's assumption and what
    the fused CUDA kernel (``native_dropout``) keeps: pass ``mask_bytes=1`` there.
    LayerNorm's statistics on a CPU are in the input's dtype (``r = e``, the
    default); CUDA's kernel allocates them in the accumulation type
    (``layer_norm_kernel.cu``: ``acc_type``, float32 for 16-bit inputs): pass
    ``stats_bytes=4`` there. The 16-bit rows model parameters and activations
    that are 16-bit themselves (a model cast to bfloat16, or FSDP2's
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``), not ``torch.autocast``:
    under CUDA autocast ``layer_norm`` and ``softmax`` run in float32 (the AMP
    operator reference lists them), so their saved input and output are 4 bytes
    per element.

    Args:
        batch: b, sequences per micro-batch.
        seq: s, tokens per sequence.
        d_model: h, the model width.
        n_heads: a, attention heads.
        element_bytes: e, 4 for float32, 2 for bfloat16/float16.
        mask_bytes: m; None means ``element_bytes``.
        stats_bytes: r, bytes of each LayerNorm statistic; None means
            ``element_bytes`` (a CPU), 4 on CUDA.
        dropout: whether the block trains with dropout > 0 (no masks otherwise,
            and the attention-weights dropout keeps nothing of its own).
        flash: the fused attention kernel (``scaled_dot_product_attention``),
            which keeps Q, K, V, its output and a log-sum-exp per row
            (``a s b`` float32) instead of any ``s x s`` matrix.

    Returns:
        The :class:`Term` s, in the order forward saves them.

    Raises:
        ValueError: non-positive sizes, ``d_model`` not a multiple of
            ``n_heads``, or ``flash`` with ``dropout`` (on a CPU the fused
            kernel has no dropout and PyTorch runs its written-out fallback,
            which keeps the same terms as ``flash=False`` but the causal mask's
            ``s^2`` bytes: predict it with ``flash=False``, exact within that term).
    """
    _check_shapes(batch, seq, d_model, n_heads)
    if flash and dropout:
        raise ValueError(
            "flash=True with dropout runs the written-out attention on a CPU: "
            "predict it with flash=False (exact within the s^2 causal-mask term)"
        )
    s, b, h, a, e = seq, batch, d_model, n_heads, element_bytes
    m = e if mask_bytes is None else mask_bytes
    r = e if stats_bytes is None else stats_bytes
    sbh = s * b * h
    terms = [
        Term("LayerNorm 1 input", "ln1", "e*sbh", e * sbh),
        Term("LayerNorm 1 mean, rstd", "ln1", "2*r*sb", 2 * r * s * b),
        Term("Q, K, V input", "q, k, v Linear", "e*sbh", e * sbh, "attention"),
    ]
    if flash:
        terms += [
            Term("Q, K, V", "attention kernel", "3*e*sbh", 3 * e * sbh, "attention", True),
            # Its output's memory is laid out [b, s, a, head_dim]: the projection's
            # input is a view of it, one storage for both.
            Term("output = projection input", "kernel, proj", "e*sbh", e * sbh, "attention"),
            Term("log-sum-exp", "attention kernel", "4*asb", 4 * a * s * b, "attention", True),
        ]
    else:
        quad = e * a * s * s * b
        terms += [
            Term("Q, K", "QK^T", "2*e*sbh", 2 * e * sbh, "attention", True),
            Term("causal mask", "masked_fill", "s^2", s * s, "attention", True),
            Term("softmax output", "softmax", "e*as^2b", quad, "attention", True),
        ]
        if dropout:
            terms += [
                Term(
                    "attention dropout mask",
                    "dropout",
                    "m*as^2b",
                    m * a * s * s * b,
                    "attention",
                    True,
                ),
                Term("dropout output", "attention x V", "e*as^2b", quad, "attention", True),
            ]
        terms.append(Term("V", "attention x V", "e*sbh", e * sbh, "attention", True))
        terms.append(Term("projection input", "proj Linear", "e*sbh", e * sbh, "attention"))
    if dropout:
        terms.append(Term("projection dropout mask", "dropout", "m*sbh", m * sbh, "attention"))
    terms += [
        Term("LayerNorm 2 input", "ln2", "e*sbh", e * sbh),
        Term("LayerNorm 2 mean, rstd", "ln2", "2*r*sb", 2 * r * s * b),
        Term("fc1 input", "fc1 Linear", "e*sbh", e * sbh, "mlp"),
        Term("GELU input", "GELU", "4*e*sbh", 4 * e * sbh, "mlp"),
        Term("fc2 input", "fc2 Linear", "4*e*sbh", 4 * e * sbh, "mlp"),
    ]
    if dropout:
        terms.append(Term("MLP dropout mask", "dropout", "m*sbh", m * sbh))
    return terms


def block_bytes(batch: int, seq: int, d_model: int, n_heads: int, **kwargs) -> int:
    """Bytes one block saves for backward: the sum of :func:`block_terms` (same arguments)."""
    return sum(t.bytes for t in block_terms(batch, seq, d_model, n_heads, **kwargs))


def korthikanti_block_bytes(seq: int, batch: int, hidden: int, heads: int) -> int:
    """``s b h (34 + 5 a s / h)``: bytes per block, 16-bit, 1-byte dropout masks.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", section 4.1, equation 1 (no tensor or sequence
    parallelism). Returns an int (the formula is a whole number of bytes).
    """
    return 34 * seq * batch * hidden + 5 * heads * seq * seq * batch


def outside_terms(
    batch: int,
    seq: int,
    d_model: int,
    vocab_size: int,
    *,
    element_bytes: int = 4,
    mask_bytes: int | None = None,
    dropout: bool = True,
    stats_bytes: int | None = None,
) -> list[Term]:
    """What TinyGPT saves outside its blocks, with :func:`~ddp_course.models.lm_loss`.

    The token ids (int64) and positions the two embeddings keep for their
    backward, the embedding dropout's mask, the final LayerNorm's input and
    statistics, the head's input, ``log_softmax``'s output ``[s b, V]`` and the
    targets (int64) and the float32 total weight that ``nll_loss`` keeps. Arguments as for
    :func:`block_terms`; ``vocab_size`` is V.
    """
    s, b, h, e = seq, batch, d_model, element_bytes
    m = e if mask_bytes is None else mask_bytes
    r = e if stats_bytes is None else stats_bytes
    terms = [
        Term("token ids", "tok_emb", "8*sb", 8 * s * b),
        Term("positions", "pos_emb", "8*s", 8 * s),
    ]
    if dropout:
        terms.append(Term("embedding dropout mask", "dropout", "m*sbh", m * s * b * h))
    terms += [
        Term("final LayerNorm input", "ln_f", "e*sbh", e * s * b * h),
        Term("final LayerNorm mean, rstd", "ln_f", "2*r*sb", 2 * r * s * b),
        Term("head input", "head Linear", "e*sbh", e * s * b * h),
        Term("log_softmax output", "cross-entropy", "e*sbV", e * s * b * vocab_size),
        Term("targets", "cross-entropy", "8*sb", 8 * s * b),
        Term("total weight", "cross-entropy", "4", 4),  # nll_loss's float32 scalar
    ]
    return terms


def parameter_count(cfg: Mapping) -> int:
    """Parameters of ``TinyGPT(**cfg)``, counted on the meta device (no memory used)."""
    with torch.device("meta"):
        model = TinyGPT(**cfg)
    return sum(p.numel() for p in model.parameters())


def model_config(cfg: Mapping) -> dict:
    """TinyGPT's keyword arguments: ``cfg`` over the defaults this lesson predicts with
    (V=256, d=64, 4 heads, 2 layers, 64 positions, no dropout, fused attention).

    Raises:
        ValueError: a key that is not one of TinyGPT's arguments.
    """
    full = {
        "vocab_size": 256,
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "seq_len": 64,
        "dropout": 0.0,
        "flash": True,
    } | dict(cfg)
    unknown = set(full) - {
        "vocab_size",
        "d_model",
        "n_heads",
        "n_layers",
        "seq_len",
        "dropout",
        "flash",
    }
    if unknown:
        raise ValueError(f"unknown TinyGPT arguments {sorted(unknown)}")
    return full


def predict_activations(
    cfg: Mapping,
    batch: int,
    seq: int,
    policy: str = "none",
    *,
    element_bytes: int = 4,
    mask_bytes: int | None = None,
    stats_bytes: int | None = None,
) -> dict[str, int]:
    """Activation bytes of TinyGPT(**cfg) under a checkpointing policy (see
    :func:`ddp_course.recompute_policies.apply_policy`), with the course's
    reentrant checkpoint (``impl="ours"``), whose saved inputs the hooks see.

    Checkpointing a region keeps its input (a block's input ``e s b h``;
    for ``every_submodule`` the two LayerNorm outputs) and recomputes the rest
    in backward, where one region's full activations live again for a while.
    ``op_sac`` keeps each block's input and its matmul outputs (Q, K, V,
    scores ``e a s^2 b``, attention x V, projection, fc1 ``4 e s b h``, fc2)
    and recomputes the element-wise operations. ``core_attention`` keeps every
    term outside the attention core (:attr:`Term.core`) and the core's inputs
    Q, K, V (``3 e s b h``): the ``a s^2 b`` terms go. ``every_linear`` keeps
    what ``none`` keeps: each Linear's checkpoint keeps the input the Linear
    saved anyway.

    Returns:
        ``{"held": bytes saved when forward returns, "recompute": bytes of the
        largest region recomputed in backward (0 for "none" and "every_linear",
        whose rerun saves only the input already held)}``.

    Raises:
        ValueError: an unknown policy or configuration, ``op_sac`` with
            ``flash=True``, or as :func:`block_terms`.
    """
    c = model_config(cfg)
    policy = "op_sac" if policy == "selective" else policy
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    if seq > c["seq_len"]:
        raise ValueError(f"seq={seq} is longer than the model's seq_len={c['seq_len']}")
    s, b, h, a, e = seq, batch, c["d_model"], c["n_heads"], element_bytes
    dropout = c["dropout"] > 0
    kw = {
        "element_bytes": e,
        "mask_bytes": mask_bytes,
        "dropout": dropout,
        "flash": c["flash"],
        "stats_bytes": stats_bytes,
    }
    out = outside_terms(
        b,
        s,
        h,
        c["vocab_size"],
        element_bytes=e,
        mask_bytes=mask_bytes,
        dropout=dropout,
        stats_bytes=stats_bytes,
    )
    outside = sum(t.bytes for t in out)
    full = block_bytes(b, s, h, a, **kw)
    sbh, n = s * b * h, c["n_layers"]
    if policy in ("none", "every_linear"):
        return {"held": outside + n * full, "recompute": 0}
    if policy == "every_block":
        return {"held": outside + n * e * sbh, "recompute": full}
    if policy == "every_other_block":
        saved = (n + 1) // 2  # blocks 0, 2, 4, ... are checkpointed
        return {"held": outside + saved * e * sbh + (n - saved) * full, "recompute": full}
    terms = block_terms(b, s, h, a, **kw)
    if policy == "every_submodule":
        # Held per block: what lies outside block.attn and block.mlp, and their inputs.
        kept = sum(t.bytes for t in terms if t.region == "block") + 2 * e * sbh
        regions = [sum(t.bytes for t in terms if t.region == r) for r in ("attention", "mlp")]
        return {"held": outside + n * kept, "recompute": max(regions)}
    if policy == "core_attention":
        core = sum(t.bytes for t in terms if t.core)
        return {"held": outside + n * (full - core + 3 * e * sbh), "recompute": core}
    if c["flash"]:
        raise ValueError("op-level SAC is predicted for flash=False only")
    # Outputs of the matmuls: Q, K, V, proj and fc2 (sbh each), attention x V (sbh),
    # fc1 (4 sbh) and the scores (a s^2 b); with the block's input.
    matmuls = e * (10 * sbh + a * s * s * b)
    return {"held": outside + n * (e * sbh + matmuls), "recompute": full}
