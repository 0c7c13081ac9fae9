"""Pipeline schedules as data: for every rank (stage), the order in which it runs the
forward (F) and backward (B) of each micro-batch; naive, GPipe and 1F1B, checked for
consistency, with the bubble formula and the number of micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

SCHEDULES = ("naive", "gpipe", "1f1b")

Schedule = list[list["Action"]]  # one ordered list of actions per rank (= stage)


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: the forward ("F") or backward ("B") of a micro-batch.

    Attributes:
        kind: ``"F"`` (forward: receive activations, run the stage, send its
            output on) or ``"B"`` (backward: receive the gradient of the
            stage's output, back-propagate, send the gradient of its input back).
        microbatch: index of the micro-batch, 0 <= microbatch < m.

    ``str(Action("F", 2))`` is ``"F2"``, the notation of the papers' figures.
    """

    kind: Literal["F", "B"]
    microbatch: int

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ValueError(f"Action kind must be 'F' or 'B', got {self.kind!r}")
        if self.microbatch < 0:
            raise ValueError(f"micro-batch index must be >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got stages={stages}")
    if microbatches < 1:
        raise ValueError(
            f"a pipeline needs at least 1 micro-batch, got microbatches={microbatches}"
        )


def naive_schedule(stages: int, microbatches: int = 1) -> Schedule:
    """Plain layer split: micro-batch i goes forward and back through all stages first.

    Every rank runs F0 B0 F1 B1 ...; with m = 1 this is one batch through a
    model split across ranks. Only one stage computes at any time.

    Args:
        stages: number of stages p (= ranks), >= 1.
        microbatches: number of micro-batches m, >= 1.

    Returns:
        p lists (rank 0 first) of 2m actions each.

    Raises:
        ValueError: p < 1 or m < 1.
    """
    _check_sizes(stages, microbatches)
    order = [Action(kind, i) for i in range(microbatches) for kind in ("F", "B")]
    return [list(order) for _ in range(stages)]


def gpipe_schedule(stages: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards.

    Every rank runs F0 ... F(m-1) then B0 ... B(m-1) (backwards in forward
    order, like ``torch.distributed.pipelining.ScheduleGPipe``). Arguments,
    result and errors as :func:`naive_schedule`'s.
    """
    _check_sizes(stages, microbatches)
    order = [Action("F", i) for i in range(microbatches)]
    order += [Action("B", i) for i in range(microbatches)]
    return [list(order) for _ in range(stages)]


def one_f_one_b_schedule(stages: int, microbatches: int) -> Schedule:
    """1F1B, also PipeDream-Flush (Narayanan et al., SC 2021, section 2.2.1).

    Stage k runs ``p - 1 - k`` warm-up forwards, then m - (p-1-k) pairs
    "F(next), B(oldest)", then the remaining p-1-k backwards (cool-down). The
    last stage alternates from the start; stage k holds at most p - k
    micro-batches' activations.

    Args:
        stages: number of stages p (= ranks), >= 1.
        microbatches: number of micro-batches m, >= p.

    Returns:
        p lists (rank 0 first) of 2m actions each.

    Raises:
        ValueError: p < 1, m < 1, or m < p (1F1B never reaches its steady
            state; ``torch.distributed.pipelining.Schedule1F1B`` refuses it too).
    """
    _check_sizes(stages, microbatches)
    if microbatches < stages:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages, got "
            f"microbatches={microbatches} < stages={stages}: use microbatches >= {stages} "
            "or the GPipe schedule"
        )
    table = []
    for k in range(stages):
        warmup = stages - 1 - k
        actions = [Action("F", i) for i in range(warmup)]
        for j in range(microbatches - warmup):
            actions += [Action("F", warmup + j), Action("B", j)]
        actions += [Action("B", i) for i in range(microbatches - warmup, microbatches)]
        table.append(actions)
    return table


_BUILDERS = {"naive": naive_schedule, "gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`) for p stages and m micro-batches.

    Raises:
        ValueError: an unknown name, or what the named builder refuses.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    return _BUILDERS[name](stages, microbatches)


def format_schedule(table: Schedule) -> str:
    """One line per rank, such as ``"rank 0: F0 F1 B0 B1"``, for printing a schedule."""
    return "\n".join(
        f"rank {k}: " + " ".join(str(a) for a in actions) for k, actions in enumerate(table)
    )


def in_flight(actions: Sequence[Action]) -> list[int]:
    """Micro-batches whose activations one rank holds after each of its actions.

    A forward stores the activations autograd needs; the backward of the same
    micro-batch frees them. The maximum of the list is the rank's peak
    activation memory in units of one micro-batch's activations.
    """
    held, counts = set(), []
    for a in actions:
        if a.kind == "F":
            held.add(a.microbatch)
        else:
            held.discard(a.microbatch)
        counts.append(len(held))
    return counts


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """GPipe's bubble (p-1)/(m+p-1): idle fraction of each stage with equal stage costs.

    Huang et al., NeurIPS 2019, section 2.3 (they write it O((K-1)/(M+K-1))
    for K partitions); 1F1B has the same bubble (Narayanan et al., SC 2021).
    """
    _check_sizes(stages, microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def check_schedule(table: Schedule, microbatches: int) -> None:
    """Check that a schedule is complete and that its messages arrive in order.

    Every rank must run F(i) and B(i) exactly once for every micro-batch, F(i)
    before B(i). The activations stage k sends to stage k+1 are received in
    the order stage k+1 runs its forwards, so both must run their forwards in
    the same order (and their backwards too, for the gradients sent back);
    otherwise an untagged ``recv`` would hand a stage another micro-batch's
    tensor: a silent wrong answer, not an error. Deadlocks are found by
    :func:`simulate`.

    Args:
        table: one list of actions per rank.
        microbatches: m.

    Raises:
        ValueError: naming the rank and what is missing, repeated or out of order.
    """
    if not table:
        raise ValueError("a schedule needs at least one rank's list of actions")
    expected = {Action(kind, i) for kind in ("F", "B") for i in range(microbatches)}
    for k, actions in enumerate(table):
        if len(set(actions)) != len(actions):
            repeated = sorted({str(a) for a in actions if actions.count(a) > 1})
            raise ValueError(f"rank {k} runs {', '.join(repeated)} more than once")
        if set(actions) != expected:
            missing = sorted(str(a) for a in expected - set(actions))
            extra = sorted(str(a) for a in set(actions) - expected)
            raise ValueError(
                f"rank {k} must run F and B of micro-batches 0..{microbatches - 1} once "
                f"each; missing: {missing or 'none'}, unexpected: {extra or 'none'}"
            )
        for i in range(microbatches):
            if actions.index(Action("B", i)) < actions.index(Action("F", i)):
                raise ValueError(f"rank {k} runs B{i} before F{i}")
    for k in range(len(table) - 1):
        for kind, sender, receiver in (("F", k, k + 1), ("B", k + 1, k)):
            sent = [a.microbatch for a in table[sender] if a.kind == kind]
            received = [a.microbatch for a in table[receiver] if a.kind == kind]
            if sent != received:
                raise ValueError(
                    f"rank {sender} sends its {kind} outputs for micro-batches {sent} but "
                    f"rank {receiver} receives them in the order {received}: both must "
                    "run them in the same order"
                )
