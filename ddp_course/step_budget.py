"""The memory of one whole training step: state, activations, the budget, and checks.

A step holds the parameters, their gradients, the optimizer's state
(:func:`state_bytes`, exact) and the activations
(:func:`ddp_course.activation_memory.predict_activations`).
:func:`predict_step` adds them up with the region a checkpointing policy
recomputes and the logits, as if all were alive at once: an upper bound of
the allocator's peak, not a prediction of it (the gradients grow while the
activations are freed in backward). :meth:`StepBudget.check` checks the bound
against a real step, measured by ``ddp_course.tools.peak_memory.measured_step_bytes``
(the CPU allocator through the profiler, or CUDA's ``max_memory_allocated``),
with a stated margin. :func:`fit_micro_batch` picks a micro-batch and a policy
under a budget, by a stated objective. :func:`peak_bound` brackets the CUDA
allocator's peak of a forward and backward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping

import torch

from ddp_course.activation_memory import model_config, predict_activations
from ddp_course.models import TinyGPT

__all__ = [
    "ALLOCATOR_BLOCK",
    "BUDGET_MARGIN",
    "PeakBound",
    "StepBudget",
    "fit_micro_batch",
    "peak_bound",
    "predict_step",
    "state_bytes",
]

#: How far above a measured step :meth:`StepBudget.check` lets the budget lie: it adds
#: every term as if alive at once, so it exceeds the allocator's peak (by about 20% for
#: the lesson's TinyGPT on a CPU); more than this margin would make it useless for sizing.
BUDGET_MARGIN = 0.5


def state_bytes(
    model: torch.nn.Module, *, optimizer: str = "adamw", element_bytes: int = 4
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, exactly.

    AdamW keeps two tensors per parameter (``exp_avg``, ``exp_avg_sq``; Loshchilov
    and Hutter 2019, algorithm 2) of the parameter's size and dtype, and one
    float32 ``step`` scalar per parameter tensor (``torch.optim.AdamW``'s
    default, ``capturable=False``, keeps it as a tensor). SGD without momentum
    keeps nothing. On a GPU those ``step`` tensors stay in host memory (not
    capturable, the foreach path), so ``4`` bytes per tensor of "optimizer" are
    not device memory there.

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
        """Sum of every field, bytes: an upper bound of the step's peak."""
        return sum(dataclasses.astuple(self))

    def check(self, measured: int, margin: float = BUDGET_MARGIN) -> float:
        """``total / measured``, once ``measured <= total <= (1 + margin) * measured``.

        Args:
            measured: bytes a real step held at its peak
                (``ddp_course.tools.peak_memory.measured_step_bytes``).
            margin: how far above ``measured`` the bound may lie (default
                :data:`BUDGET_MARGIN`).

        Raises:
            ValueError: the step held more than the bound (a term is missing) or
                the bound is more than ``margin`` above it (too loose to size with).
        """
        if not measured <= self.total <= (1 + margin) * measured:
            raise ValueError(
                f"the budget of {self.total:,} B is no upper bound within {margin:.0%} "
                f"of the measured {measured:,} B"
            )
        return self.total / measured


@functools.lru_cache(maxsize=64)
def _state_of(items: tuple, optimizer: str) -> dict[str, int]:
    # The state does not depend on the batch: build the meta model once per configuration
    # (fit_micro_batch's bisection asks for it dozens of times).
    with torch.device("meta"):
        model = TinyGPT(**dict(items))
    return state_bytes(model, optimizer=optimizer)


def predict_step(
    cfg: Mapping, batch: int, seq: int, policy: str = "none", optimizer: str = "adamw"
) -> StepBudget:
    """Predict a step's :class:`StepBudget` before running it (float32 on one process).

    Raises:
        ValueError: as :func:`predict_activations` and :func:`state_bytes`.
    """
    c = model_config(cfg)
    state = _state_of(tuple(sorted(c.items())), optimizer)
    act = predict_activations(c, batch, seq, policy)
    logits = 4 * batch * seq * c["vocab_size"]
    return StepBudget(**state, activations=act["held"], recompute=act["recompute"], logits=logits)


def _largest_batch(cfg, budget_bytes, seq, policy, optimizer, max_batch) -> int:
    """The largest micro-batch whose predicted step fits under ``policy``; 0 if none."""
    if predict_step(cfg, 1, seq, policy, optimizer).total > budget_bytes:
        return 0
    lo, hi = 1, max_batch
    while lo < hi:  # the largest batch that fits lies in [lo, hi]
        mid = (lo + hi + 1) // 2
        if predict_step(cfg, mid, seq, policy, optimizer).total <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_micro_batch(
    cfg: Mapping,
    budget_bytes: int,
    seq: int,
    policies: Iterable[str] = ("none", "every_other_block", "every_block"),
    optimizer: str = "adamw",
    max_batch: int = 1 << 16,
    target_batch: int | None = None,
) -> tuple[str, int, StepBudget]:
    """A micro-batch and a policy whose predicted step fits ``budget_bytes``.

    List ``policies`` from the least recomputation to the most (the default
    is: none, half the blocks, every block). Each policy's largest micro-batch
    is found by bisection on :func:`predict_step` (its total grows with the
    batch). The objective:

    - ``target_batch=None``: the largest micro-batch; on a tie, the policy
      listed first. More recomputation always fits more, so this picks the
      most recomputing policy that buys a sample more.
    - ``target_batch=n``: the cheapest policy that fits ``n`` samples, the
      first listed whose largest micro-batch reaches ``n``; returned with
      micro-batch ``n``. This is the usual choice: the batch is fixed by the
      optimisation, and recomputation costs time (a third more FLOPs for every
      block, see ``activation_checkpoint``).

    Returns:
        ``(policy, micro_batch, budget)``: ``budget.total <= budget_bytes``;
        with no target, one more sample would not fit under that policy.

    Raises:
        ValueError: not even one sample (or not ``target_batch``) fits under
            any policy (the state alone may be too large: shard it, lesson 09).
    """
    policies = tuple(policies)
    largest = {p: _largest_batch(cfg, budget_bytes, seq, p, optimizer, max_batch) for p in policies}
    if target_batch is not None:
        fits = [p for p in policies if largest[p] >= target_batch]
        if not fits:
            raise ValueError(
                f"{target_batch} samples fit under no policy of {policies} in the budget of "
                f"{budget_bytes:,} bytes (at most {max(largest.values())})"
            )
        return fits[0], target_batch, predict_step(cfg, target_batch, seq, fits[0], optimizer)
    best = max(policies, key=lambda p: largest[p])  # the first listed on a tie
    if largest[best] == 0:
        need = min(predict_step(cfg, 1, seq, p, optimizer).total for p in policies)
        raise ValueError(
            f"one sample needs {need:,} bytes, more than the budget of {budget_bytes:,}: "
            "shard the model's state or shorten the sequence"
        )
    return best, largest[best], predict_step(cfg, largest[best], seq, best, optimizer)


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
    *,
    activations: int,
    recompute: int,
    gradients: int,
    logits: int,
    largest: int,
    tensors: int,
) -> PeakBound:
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
    high = (
        activations + recompute + gradients + 3 * logits + 2 * largest + ALLOCATOR_BLOCK * tensors
    )
    return PeakBound(low=activations + logits, high=high)
