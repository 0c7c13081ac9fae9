"""The memory of one training step: bytes saved for backward, measured and predicted.

A training step holds four kinds of bytes: the parameters, their gradients, the
optimizer's state and the activations, the tensors that forward saves for
backward. The first three follow from the parameter count; the activations
follow from the shapes of one micro-batch. This module measures the
activations on any device with ``torch.autograd.graph.saved_tensors_hooks``
(:class:`SavedTensorCounter`), predicts them per Transformer block term by
term (:func:`block_terms`, adapted from Korthikanti et al. 2022, section 4),
adds up a whole step (:func:`predict_step`) and picks the largest micro-batch
that fits a budget (:func:`fit_micro_batch`).

The model is :class:`ddp_course.models.TinyGPT`; its configuration is a dict
of TinyGPT's keyword arguments (``vocab_size``, ``d_model``, ``n_heads``,
``n_layers``, ``seq_len``, ``dropout``, ``flash``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import torch

from ddp_course.models import TinyGPT

__all__ = [
    "ALLOCATOR_BLOCK",
    "POLICIES",
    "PeakBound",
    "SavedTensorCounter",
    "StepBudget",
    "Term",
    "block_bytes",
    "block_terms",
    "fit_micro_batch",
    "korthikanti_block_bytes",
    "outside_terms",
    "parameter_count",
    "peak_bound",
    "predict_activations",
    "predict_step",
    "profiled_peak_bytes",
    "state_bytes",
]

#: The checkpointing policies this lesson compares (see ``activation_checkpoint``).
POLICIES = ("none", "every_block", "every_other_block", "every_submodule", "selective")


class SavedTensorCounter:
    """Count the bytes that autograd saves for backward inside a ``with`` block.

    Every tensor an operation saves passes through the pack hook of
    ``torch.autograd.graph.saved_tensors_hooks``
    (https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks). A
    tensor and its views share one storage (the 2-D view ``x.view(-1, d)``
    that ``nn.Linear`` saves is the same memory as ``x``), so each storage is
    counted once, at its full size ``untyped_storage().nbytes()``. Storages of
    the given parameters are counted apart: a weight saved for backward is
    memory the model holds anyway, not an activation.

    A storage seen in one ``with`` block stays counted until :meth:`reset`.
    Tensors saved inside a checkpointed region of
    ``torch.utils.checkpoint`` (which installs hooks of its own) are not seen.

    Args:
        parameters: the model's parameters (their storages are not activations).
        count_views_once: ``False`` counts every saved tensor at its own size
            (``numel * element_size``), views included: the wrong count this
            lesson shows once.

    Attributes:
        activation_bytes: bytes of the distinct non-parameter storages saved.
        parameter_bytes: bytes of the distinct parameter storages saved.
        saved: one ``(shape, dtype, bytes, kind)`` tuple per saved tensor, in
            order; ``kind`` is ``"activation"``, ``"view"`` (a storage seen
            before) or ``"parameter"``.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = (), count_views_once: bool = True):
        self.count_views_once = count_views_once
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._hooks = None
        self.reset()

    def reset(self) -> None:
        """Forget what was counted."""
        self.activation_bytes = 0
        self.parameter_bytes = 0
        self.saved: list[tuple[tuple[int, ...], torch.dtype, int, str]] = []
        self._seen: set[int] = set()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # A held reference keeps the storage alive until backward, so its address is
        # not reused by another tensor of the same forward and identifies it.
        key = storage.data_ptr()
        if key in self._parameter_storages:
            kind, size = "parameter", storage.nbytes()
            if key not in self._seen:
                self.parameter_bytes += size
        elif not self.count_views_once:
            kind, size = "activation", tensor.numel() * tensor.element_size()
            self.activation_bytes += size
        elif key in self._seen:
            kind, size = "view", 0
        else:
            kind, size = "activation", storage.nbytes()
            self.activation_bytes += size
        self._seen.add(key)
        self.saved.append((tuple(tensor.shape), tensor.dtype, size, kind))
        return tensor

    def __enter__(self) -> SavedTensorCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


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
    """

    name: str
    saved_by: str
    formula: str
    bytes: int
    region: str = "block"


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
    LayerNorm's mean and reciprocal standard deviation (``2 s b`` floats of 4
    bytes) and the causal mask (``s^2`` bools) that ``masked_fill`` keeps.

    PyTorch's dropout on a CPU multiplies by a mask in the input's dtype, so
    ``m`` defaults to ``e``; a 1-byte mask is the paper's assumption and what
    the fused CUDA kernel (``native_dropout``) keeps: pass ``mask_bytes=1`` there.

    Args:
        batch: b, sequences per micro-batch.
        seq: s, tokens per sequence.
        d_model: h, the model width.
        n_heads: a, attention heads.
        element_bytes: e, 4 for float32, 2 for bfloat16/float16.
        mask_bytes: m; None means ``element_bytes``.
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
            kernel has no dropout and PyTorch runs the written-out attention:
            predict with ``flash=False``).
    """
    _check_shapes(batch, seq, d_model, n_heads)
    if flash and dropout:
        raise ValueError(
            "flash=True with dropout runs the written-out attention on a CPU: "
            "predict it with flash=False"
        )
    s, b, h, a, e = seq, batch, d_model, n_heads, element_bytes
    m = e if mask_bytes is None else mask_bytes
    sbh = s * b * h
    terms = [
        Term("LayerNorm 1 input", "ln1", "e*sbh", e * sbh),
        Term("LayerNorm 1 mean, rstd", "ln1", "2*e*sb", 2 * e * s * b),
        Term("Q, K, V input", "q, k, v Linear", "e*sbh", e * sbh, "attention"),
    ]
    if flash:
        terms += [
            Term("Q, K, V", "attention kernel", "3*e*sbh", 3 * e * sbh, "attention"),
            # Its output's memory is laid out [b, s, a, head_dim]: the projection's
            # input is a view of it, one storage for both.
            Term("output = projection input", "kernel, proj", "e*sbh", e * sbh, "attention"),
            Term("log-sum-exp", "attention kernel", "4*asb", 4 * a * s * b, "attention"),
        ]
    else:
        terms += [
            Term("Q, K", "QK^T", "2*e*sbh", 2 * e * sbh, "attention"),
            Term("causal mask", "masked_fill", "s^2", s * s, "attention"),
            Term("softmax output", "softmax", "e*as^2b", e * a * s * s * b, "attention"),
        ]
        if dropout:
            terms += [
                Term(
                    "attention dropout mask", "dropout", "m*as^2b", m * a * s * s * b, "attention"
                ),
                Term("dropout output", "attention x V", "e*as^2b", e * a * s * s * b, "attention"),
            ]
        terms.append(Term("V", "attention x V", "e*sbh", e * sbh, "attention"))
        terms.append(Term("projection input", "proj Linear", "e*sbh", e * sbh, "attention"))
    if dropout:
        terms.append(Term("projection dropout mask", "dropout", "m*sbh", m * sbh, "attention"))
    terms += [
        Term("LayerNorm 2 input", "ln2", "e*sbh", e * sbh),
        Term("LayerNorm 2 mean, rstd", "ln2", "2*e*sb", 2 * e * s * b),
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
    batch: int, seq: int, d_model: int, vocab_size: int, *, element_bytes: int = 4,
    mask_bytes: int | None = None, dropout: bool = True,
) -> list[Term]:  # fmt: skip
    """What TinyGPT saves outside its blocks, with :func:`~ddp_course.models.lm_loss`.

    The token ids (int64) and positions the two embeddings keep for their
    backward, the embedding dropout's mask, the final LayerNorm's input and
    statistics, the head's input, ``log_softmax``'s output ``[s b, V]`` and the
    targets (int64) and the float32 total weight that ``nll_loss`` keeps. Arguments as for
    :func:`block_terms`; ``vocab_size`` is V.
    """
    s, b, h, e = seq, batch, d_model, element_bytes
    m = e if mask_bytes is None else mask_bytes
    terms = [
        Term("token ids", "tok_emb", "8*sb", 8 * s * b),
        Term("positions", "pos_emb", "8*s", 8 * s),
    ]
    if dropout:
        terms.append(Term("embedding dropout mask", "dropout", "m*sbh", m * s * b * h))
    terms += [
        Term("final LayerNorm input", "ln_f", "e*sbh", e * s * b * h),
        Term("final LayerNorm mean, rstd", "ln_f", "2*e*sb", 2 * e * s * b),
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


def _cfg(cfg: Mapping) -> dict:
    full = {"vocab_size": 256, "d_model": 64, "n_heads": 4, "n_layers": 2, "seq_len": 64,
            "dropout": 0.0, "flash": True} | dict(cfg)  # fmt: skip
    unknown = set(full) - {"vocab_size", "d_model", "n_heads", "n_layers", "seq_len",
                           "dropout", "flash"}  # fmt: skip
    if unknown:
        raise ValueError(f"unknown TinyGPT arguments {sorted(unknown)}")
    return full


def predict_activations(
    cfg: Mapping, batch: int, seq: int, policy: str = "none", *, element_bytes: int = 4,
    mask_bytes: int | None = None,
) -> dict[str, int]:  # fmt: skip
    """Activation bytes of TinyGPT(**cfg) under a checkpointing policy.

    Checkpointing a region keeps its input (a block's input ``e s b h``;
    for ``every_submodule`` the two LayerNorm outputs) and recomputes the rest
    in backward, where one region's full activations live again for a while.
    ``selective`` keeps each block's input and its matmul outputs (Q, K, V,
    scores ``e a s^2 b``, attention x V, projection, fc1 ``4 e s b h``, fc2)
    and recomputes the element-wise operations.

    Returns:
        ``{"held": bytes saved when forward returns, "recompute": bytes of the
        largest region recomputed in backward (0 for "none")}``.

    Raises:
        ValueError: an unknown policy or configuration, or as :func:`block_terms`.
    """
    c = _cfg(cfg)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    if seq > c["seq_len"]:
        raise ValueError(f"seq={seq} is longer than the model's seq_len={c['seq_len']}")
    s, b, h, a, e = seq, batch, c["d_model"], c["n_heads"], element_bytes
    dropout = c["dropout"] > 0
    kw = {"element_bytes": e, "mask_bytes": mask_bytes, "dropout": dropout, "flash": c["flash"]}
    out = outside_terms(b, s, h, c["vocab_size"], element_bytes=e, mask_bytes=mask_bytes,
                        dropout=dropout)  # fmt: skip
    outside = sum(t.bytes for t in out)
    full = block_bytes(b, s, h, a, **kw)
    sbh, n = s * b * h, c["n_layers"]
    if policy == "none":
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
    if c["flash"]:
        raise ValueError("selective checkpointing is predicted for flash=False only")
    # Outputs of the matmuls: Q, K, V, proj and fc2 (sbh each), attention x V (sbh),
    # fc1 (4 sbh) and the scores (a s^2 b); with the block's input.
    matmuls = e * (10 * sbh + a * s * s * b)
    return {"held": outside + n * (e * sbh + matmuls), "recompute": full}


def state_bytes(
    model: torch.nn.Module, *, optimizer: str = "adamw", element_bytes: int = 4
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, exactly.

    AdamW keeps two tensors per parameter (``exp_avg``, ``exp_avg_sq``; Loshchilov
    and Hutter 2019, algorithm 2) of the parameter's size and dtype, and one
    float32 ``step`` scalar per parameter tensor (``torch.optim.AdamW``'s
    default, ``capturable=False``, keeps it as a tensor). SGD without momentum
    keeps nothing.

    Args:
        model: its parameters (on any device, ``meta`` included).
        optimizer: ``"adamw"`` or ``"sgd"``.
        element_bytes: bytes per element of parameters, gradients and state.

    Returns:
        ``{"parameters", "gradients", "optimizer"}`` in bytes.

    Raises:
        ValueError: an unknown optimizer.
    """
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', not {optimizer!r}")
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    opt = (2 * n * element_bytes + 4 * len(params)) if optimizer == "adamw" else 0
    return {"parameters": n * element_bytes, "gradients": n * element_bytes, "optimizer": opt}


@dataclasses.dataclass(frozen=True)
class StepBudget:
    """Predicted bytes of one training step of TinyGPT (one process, float32).

    Attributes:
        parameters, gradients, optimizer: :func:`state_bytes`.
        activations: held when forward returns (:func:`predict_activations`).
        recompute: the largest checkpointed region, alive again in backward.
        logits: the ``[b, s, V]`` logits the caller holds until the loss is
            computed (not saved for backward: ``log_softmax`` saves its output).
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    recompute: int
    logits: int

    @property
    def total(self) -> int:
        """Sum of every field, bytes."""
        return sum(dataclasses.astuple(self))


def predict_step(cfg: Mapping, batch: int, seq: int, policy: str = "none",
                 optimizer: str = "adamw") -> StepBudget:  # fmt: skip
    """Predict a step's :class:`StepBudget` before running it (float32 on one process).

    Raises:
        ValueError: as :func:`predict_activations` and :func:`state_bytes`.
    """
    c = _cfg(cfg)
    with torch.device("meta"):
        model = TinyGPT(**c)
    state = state_bytes(model, optimizer=optimizer)
    act = predict_activations(c, batch, seq, policy)
    logits = 4 * batch * seq * c["vocab_size"]
    return StepBudget(**state, activations=act["held"], recompute=act["recompute"],
                      logits=logits)  # fmt: skip


def fit_micro_batch(
    cfg: Mapping,
    budget_bytes: int,
    seq: int,
    policies: Iterable[str] = ("none", "every_other_block", "every_block"),
    optimizer: str = "adamw",
    max_batch: int = 1 << 16,
) -> tuple[str, int, StepBudget]:
    """The largest micro-batch whose predicted step fits ``budget_bytes``, and its policy.

    Each policy's largest micro-batch is found by bisection on
    :func:`predict_step` (its total grows with the batch). The policy with
    the largest micro-batch wins; on a tie, the one listed first (list them
    from the least recomputation to the most).

    Returns:
        ``(policy, micro_batch, budget)``: ``budget.total <= budget_bytes`` and
        one more sample would not fit under that policy.

    Raises:
        ValueError: not even one sample fits under any policy (the state
            alone may be too large: shard it, lesson 09).
    """
    best = None
    for policy in policies:
        if predict_step(cfg, 1, seq, policy, optimizer).total > budget_bytes:
            continue
        lo, hi = 1, max_batch
        while lo < hi:  # the largest batch that fits lies in [lo, hi]
            mid = (lo + hi + 1) // 2
            if predict_step(cfg, mid, seq, policy, optimizer).total <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        if best is None or lo > best[1]:
            best = (policy, lo, predict_step(cfg, lo, seq, policy, optimizer))
    if best is None:
        need = min(predict_step(cfg, 1, seq, p, optimizer).total for p in policies)
        raise ValueError(
            f"one sample needs {need:,} bytes, more than the budget of {budget_bytes:,}: "
            "shard the model's state or shorten the sequence"
        )
    return best


#: Bytes: CUDA's caching allocator hands out blocks of a multiple of 512 bytes
#: (``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``), and
#: ``torch.cuda.max_memory_allocated`` counts blocks, not the tensors' bytes.
ALLOCATOR_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class PeakBound:
    """Where an allocator's peak over one forward and backward must lie, bytes.

    Attributes:
        low: what must be alive at once (see :func:`peak_bound`).
        high: everything that may be alive at once.
    """

    low: int
    high: int

    def check(self, peak: int) -> float:
        """``peak`` as a fraction of :attr:`high`, once it is checked to lie in the bound.

        Raises:
            ValueError: ``peak`` below :attr:`low` (the prediction counts bytes that were
                never allocated) or above :attr:`high` (something the prediction leaves
                out was alive).
        """
        if not self.low <= peak <= self.high:
            raise ValueError(
                f"allocator peak {peak:,} B outside the predicted bound "
                f"[{self.low:,}, {self.high:,}] B"
            )
        return peak / self.high


def peak_bound(
    *, activations: int, recompute: int, gradients: int, logits: int, largest: int,
    tensors: int,
) -> PeakBound:  # fmt: skip
    """Bound an allocator's peak during one forward and backward, above the weights.

    - Low: when forward ends, every activation saved for backward is alive, and so are the
      logits (the log-softmax reads them; its output is one of the activations):
      ``activations + logits``.
    - High: at most everything at once: the activations, the largest region recomputed in
      backward, every gradient, the logits and the two gradients of their size the loss's
      backward holds together (with respect to the log-probabilities and to the logits),
      an operation's backward holding the gradients of its output and its input (twice the
      largest tensor of a block), and the allocator's rounding: less than
      :data:`ALLOCATOR_BLOCK` bytes per live tensor, ``tensors`` of them at most.

    Args:
        activations, recompute: :func:`predict_activations`' ``held`` and ``recompute``.
        gradients: bytes of the parameters' gradients (:func:`state_bytes`).
        logits: bytes of the ``[b, s, V]`` logits.
        largest: bytes of the largest tensor inside a block (the scores ``e a s^2 b`` of the
            written-out attention, or the MLP's ``4 e s b h``).
        tensors: tensors alive at once, at most: the saved storages, the gradients and a
            few temporaries.

    Raises:
        ValueError: a negative term.
    """
    terms = (activations, recompute, gradients, logits, largest, tensors)
    if min(terms) < 0:
        raise ValueError(f"the terms of the bound must not be negative: {terms}")
    high = (activations + recompute + gradients + 3 * logits + 2 * largest
            + ALLOCATOR_BLOCK * tensors)  # fmt: skip
    return PeakBound(low=activations + logits, high=high)


def profiled_peak_bytes(fn: Callable[[], object]) -> int:
    """The CPU allocator's peak during ``fn()``, bytes above what was allocated before.

    Runs ``fn`` under ``torch.profiler.profile(profile_memory=True)``
    (https://pytorch.org/docs/stable/profiler.html) and adds up, in time
    order, the bytes each recorded operator allocated and freed itself
    (``self_cpu_memory_usage``; a free is negative). An allocation and a free
    inside one operator cancel, so this is a lower bound of the true peak at
    operator granularity. On a GPU use ``torch.cuda.max_memory_allocated``.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted(
        (ev.time_range.start, ev.self_cpu_memory_usage)
        for ev in prof.events()
        if ev.self_cpu_memory_usage
    )
    peak = live = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return peak
