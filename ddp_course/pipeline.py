"""Pipeline parallelism as data: schedules, a deadlock check, a timeline (notebook 08).

A model split into p stages, one per rank, processes a batch cut into m
micro-batches. A *schedule* says, for every rank, the order in which it runs
the forward (F) and backward (B) of each micro-batch:

- naive: one micro-batch at a time goes through the whole pipe, forward and
  back, before the next enters (a plain layer split, with gradient
  accumulation when m > 1): one stage busy at a time;
- GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks
  using Pipeline Parallelism", NeurIPS 2019): all m forwards, then all m
  backwards (in forward order, as ``torch.distributed.pipelining.ScheduleGPipe``);
  idle fraction (the *bubble*) (p-1)/(m+p-1), activations of m micro-batches
  held at once;
- 1F1B (PipeDream-Flush; Narayanan et al., "Efficient Large-Scale Language
  Model Training on GPU Clusters using Megatron-LM", SC 2021): stage k runs
  p-1-k warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards; same bubble as GPipe, but stage k holds the
  activations of at most p-k micro-batches.

:func:`simulate` runs a schedule with blocking point-to-point semantics (a
stage's F(i) waits for the previous stage's F(i), its B(i) for the next
stage's B(i)) and per-action costs; it reports a deadlock, naming where each
rank is stuck, or a :class:`Timeline` with start and end times, from which
the bubble and the peak number of in-flight micro-batches are read, and
which :meth:`Timeline.render` draws as a text Gantt chart.

:func:`run_schedule` executes one rank's part of a schedule for real: stage
k of the model on rank k, activations and gradients passed with
``torch.distributed`` point-to-point operations (``recv`` and ``isend``),
micro-batch gradients accumulated so that one pipelined step equals one step
on the whole batch. It time-stamps every action; :func:`gather_timeline`
collects the stamps of all ranks into the same :class:`Timeline`, so the
measurement and the simulation are read the same way.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Event",
    "Timeline",
    "check_schedule",
    "StepResult",
    "format_schedule",
    "gather_timeline",
    "gpipe_bubble",
    "gpipe_schedule",
    "in_flight",
    "naive_schedule",
    "one_f_one_b_schedule",
    "run_schedule",
    "schedule",
    "simulate",
    "split_microbatches",
    "split_model",
]

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
    order, like ``torch.distributed.pipelining.ScheduleGPipe``).

    Args:
        stages: number of stages p (= ranks), >= 1.
        microbatches: number of micro-batches m, >= 1.

    Returns:
        p lists (rank 0 first) of 2m actions each.

    Raises:
        ValueError: p < 1 or m < 1.
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


@dataclasses.dataclass(frozen=True)
class Event:
    """One action of one rank with its start and end times (seconds, or any one unit)."""

    rank: int
    action: Action
    start: float
    end: float


class DeadlockError(ValueError):
    """A schedule in which every unfinished rank waits for another: it would hang.

    Attributes:
        blocked: for each stuck rank, ``(position, action, (peer, peer_action))``:
            the index of the action it is stuck at in its list, that action,
            and the other rank's action it waits for.
    """

    def __init__(self, blocked: dict[int, tuple[int, Action, tuple[int, Action]]]):
        self.blocked = blocked
        where = "; ".join(
            f"rank {k} waits at {a} (its action {pos}) for rank {peer}'s {need}"
            for k, (pos, a, (peer, need)) in sorted(blocked.items())
        )
        super().__init__(f"the schedule deadlocks: {where}")


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Start and end times of every action of every rank, simulated or measured.

    Attributes:
        events: one :class:`Event` per action; per rank in execution order.
    """

    events: tuple[Event, ...]

    @property
    def ranks(self) -> int:
        """Number of ranks that appear in the timeline."""
        return 1 + max(e.rank for e in self.events)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end over all ranks (one pipelined step)."""
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def of_rank(self, rank: int) -> list[Event]:
        """The events of one rank, ordered by start time."""
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: e.start)

    def busy(self, rank: int) -> float:
        """Time the rank spends computing (sum of its action durations)."""
        return sum(e.end - e.start for e in self.of_rank(rank))

    def bubble(self, rank: int) -> float:
        """Idle fraction of the rank over the whole step: 1 - busy / makespan."""
        return 1.0 - self.busy(rank) / self.makespan

    def bubbles(self) -> list[float]:
        """:meth:`bubble` of every rank, rank 0 first."""
        return [self.bubble(k) for k in range(self.ranks)]

    def peak_in_flight(self, rank: int) -> int:
        """Most micro-batches whose activations the rank held at once (see :func:`in_flight`)."""
        return max(in_flight([e.action for e in self.of_rank(rank)]))

    def relative(self) -> Timeline:
        """The same timeline with the first start at time 0 (for tables and Gantt charts)."""
        t0 = min(e.start for e in self.events)
        return Timeline(
            tuple(dataclasses.replace(e, start=e.start - t0, end=e.end - t0) for e in self.events)
        )

    def to_records(self) -> list[dict]:
        """JSON-ready rows ``{"rank", "action", "start", "end"}``, action as ``"F3"``."""
        return [
            {"rank": e.rank, "action": str(e.action), "start": e.start, "end": e.end}
            for e in self.events
        ]

    def render(self, unit: float = 1.0) -> str:
        """A text Gantt chart: one line per rank, one column per ``unit`` of time.

        A column shows the action running at the middle of its time slot, or
        ``.`` when the rank is idle, e.g. for GPipe with p = 2, m = 2,
        t_f = 1 and t_b = 2::

            rank 0: F0 F1 .  .  .  B0 B0 B1 B1
            rank 1: .  F0 F1 B0 B0 B1 B1 .  .

        Raises:
            ValueError: ``unit`` <= 0.
        """
        if unit <= 0:
            raise ValueError(f"unit must be > 0 seconds, got {unit}")
        tl = self.relative()
        width = max(len(str(e.action)) for e in tl.events)
        slots = math.ceil(tl.makespan / unit - 1e-9)
        lines = []
        for k in range(tl.ranks):
            cells = []
            for s in range(slots):
                t = (s + 0.5) * unit
                running = [e for e in tl.of_rank(k) if e.start <= t < e.end]
                cells.append((str(running[0].action) if running else ".").ljust(width))
            lines.append(f"rank {k}: " + " ".join(cells).rstrip())
        return "\n".join(lines)

    @classmethod
    def from_records(cls, records: Sequence[dict]) -> Timeline:
        """The inverse of :meth:`to_records` (e.g. a script's JSON results read back)."""
        return cls(
            tuple(
                Event(r["rank"], Action(r["action"][0], int(r["action"][1:])), r["start"], r["end"])
                for r in records
            )
        )


def _per_stage(cost: float | Sequence[float], stages: int, name: str) -> list[float]:
    costs = [float(cost)] * stages if isinstance(cost, (int, float)) else [float(c) for c in cost]
    if len(costs) != stages:
        raise ValueError(f"{name} needs one cost per stage ({stages}), got {len(costs)}")
    if any(c < 0 for c in costs):
        raise ValueError(f"{name} must be >= 0, got {costs}")
    return costs


def _dependency(rank: int, action: Action, stages: int) -> tuple[int, Action] | None:
    """The other rank's action whose message this action receives, if any."""
    if action.kind == "F" and rank > 0:
        return rank - 1, action
    if action.kind == "B" and rank < stages - 1:
        return rank + 1, action
    return None


def simulate(
    table: Schedule,
    forward_cost: float | Sequence[float] = 1.0,
    backward_cost: float | Sequence[float] = 2.0,
    comm_cost: float = 0.0,
) -> Timeline:
    """Run a schedule on paper: every rank executes its actions in order, blocking on receives.

    Stage k's F(i) starts when stage k-1's F(i) has ended (its activations
    arrive ``comm_cost`` later) and stage k's previous action is done; B(i)
    likewise waits for stage k+1's B(i), and for the rank's own F(i). Sends
    do not block (as ``isend``). Each action starts as early as that allows.

    Args:
        table: one list of actions per rank (rank k runs stage k).
        forward_cost: duration of one micro-batch's forward, one value or one per stage.
        backward_cost: the same for the backward (about twice the forward in
            practice: gradients with respect to inputs and to weights).
        comm_cost: delay of one point-to-point message between neighbours.

    Returns:
        The :class:`Timeline` of the step.

    Raises:
        DeadlockError: every rank that has not finished waits for an action
            that cannot happen first; the error names each stuck rank.
        ValueError: costs of the wrong length or negative; a rank's B(i)
            before its own F(i) or a missing action (see :func:`check_schedule`).
    """
    stages = len(table)
    if stages < 1:
        raise ValueError("a schedule needs at least one rank's list of actions")
    t_f = _per_stage(forward_cost, stages, "forward_cost")
    t_b = _per_stage(backward_cost, stages, "backward_cost")
    ends: dict[tuple[int, Action], float] = {}
    position = [0] * stages
    free_at = [0.0] * stages
    events: list[Event] = []
    progressed = True
    while progressed:
        progressed = False
        for k in range(stages):
            while position[k] < len(table[k]):
                action = table[k][position[k]]
                ready = free_at[k]
                if action.kind == "B":
                    if (k, Action("F", action.microbatch)) not in ends:
                        raise ValueError(f"rank {k} runs {action} before F{action.microbatch}")
                dep = _dependency(k, action, stages)
                if dep is not None:
                    if dep not in ends:
                        break
                    ready = max(ready, ends[dep] + comm_cost)
                end = ready + (t_f[k] if action.kind == "F" else t_b[k])
                ends[(k, action)] = end
                events.append(Event(k, action, ready, end))
                free_at[k] = end
                position[k] += 1
                progressed = True
    stuck = {
        k: (position[k], table[k][position[k]], _dependency(k, table[k][position[k]], stages))
        for k in range(stages)
        if position[k] < len(table[k])
    }
    if stuck:
        for k, (_, action, dep) in stuck.items():
            peer, _need = dep
            if not any(a == action for a in table[peer]):
                raise ValueError(f"rank {k} waits for rank {peer}'s {action}, which it never runs")
        raise DeadlockError(stuck)
    return Timeline(tuple(events))


def split_microbatches(batch: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """Cut a batch along dimension 0 into m micro-batches (``torch.tensor_split``).

    Sizes differ by at most one sample when m does not divide the batch.

    Raises:
        ValueError: m < 1 or m larger than the batch (an empty micro-batch).
    """
    if not 1 <= microbatches <= len(batch):
        raise ValueError(
            f"cannot cut a batch of {len(batch)} samples into {microbatches} micro-batches: "
            f"use 1 <= microbatches <= {len(batch)}"
        )
    return list(torch.tensor_split(batch, microbatches))


def split_model(model: nn.Sequential, stages: int, index: int) -> nn.Sequential:
    """Stage ``index`` of ``stages``: a contiguous slice of ``model``'s layers (shared, not copied).

    The layers are cut as evenly as their count allows (stage k gets layers
    ``round(k n / p)`` to ``round((k+1) n / p)``), so every stage has at least
    one layer.

    Args:
        model: the whole model as an ``nn.Sequential`` of n layers.
        stages: number of stages p (= pipeline ranks), 1 <= p <= n.
        index: this stage, 0 <= index < p (usually the rank).

    Returns:
        An ``nn.Sequential`` of this stage's layers, the same module objects
        as in ``model``.

    Raises:
        ValueError: p < 1, more stages than layers (a stage would be empty:
            use fewer ranks or a deeper model), or ``index`` out of range.
    """
    n = len(model)
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got stages={stages}")
    if stages > n:
        raise ValueError(
            f"cannot split a model of {n} layers into {stages} stages: a stage would be "
            f"empty; run at most {n} ranks or give the model more layers"
        )
    if not 0 <= index < stages:
        raise ValueError(f"stage index must be in [0, {stages}), got {index}")
    bounds = [round(k * n / stages) for k in range(stages + 1)]
    return nn.Sequential(*list(model)[bounds[index] : bounds[index + 1]])


@dataclasses.dataclass
class StepResult:
    """What one rank did in one pipelined step.

    Attributes:
        events: this rank's actions with start and end times (seconds of
            ``time.perf_counter``, one clock for all processes of a machine);
            an action starts when its input has arrived, so waiting is idle time,
            and ends when its output is ready, before the send is posted.
        peak_in_flight: most micro-batches whose activations this rank held
            at once (counted in the executor, not read from the schedule).
        loss: the whole batch's loss (last stage; ``None`` elsewhere), equal
            to ``loss_fn`` on the whole batch when ``loss_fn`` averages.
        bytes_sent: payload bytes this rank sent (activations forward,
            gradients backward; ``numel * element_size``, the small shape
            headers not counted).
    """

    events: list[Event]
    peak_in_flight: int
    loss: float | None
    bytes_sent: int = 0


_HEADER = 8  # int64 header: number of dimensions, then the shape


def _send(tensor: torch.Tensor, peer: int, pending: list) -> int:
    """Post a non-blocking send of a tensor and of its shape; return the payload bytes."""
    if tensor.dim() >= _HEADER:
        raise ValueError(f"pipeline messages support at most {_HEADER - 1} dimensions")
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0] = tensor.dim()
    header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    payload = tensor.detach().contiguous()
    # Keep both tensors alive until the send completes (wait at the end of the step).
    pending += [(dist.isend(header, peer), header), (dist.isend(payload, peer), payload)]
    return payload.numel() * payload.element_size()


def _recv(peer: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, peer)
    shape = header[1 : 1 + int(header[0])].tolist()
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, peer)
    return tensor


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued kernels are done (CUDA runs async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def run_schedule(
    table: Schedule,
    stage: nn.Module,
    rank: int,
    inputs: Sequence[torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    forward_sleep_s: float = 0.0,
    backward_sleep_s: float = 0.0,
) -> StepResult:
    """Run rank ``rank``'s actions of a pipeline schedule on its stage; accumulate gradients.

    Rank k runs stage k. F(i): receive micro-batch i's activations from rank
    k-1 (rank 0 takes ``inputs[i]``), run the stage, send the output to rank
    k+1 (the last rank computes the loss instead). B(i): receive the gradient
    of the output from rank k+1 (the last rank back-propagates its loss), back-
    propagate through the stage, send the gradient of the input to rank k-1.
    Sends are ``isend`` and awaited at the end, receives block; so the run
    follows :func:`simulate`'s semantics, and a schedule that simulates
    without deadlock runs without one.

    The loss of micro-batch i is weighted by n_i / N (its share of the N
    samples), so with a ``loss_fn`` that averages (the default of
    ``nn.functional.cross_entropy``) the accumulated gradients equal those of
    one backward over the whole batch (Huang et al., NeurIPS 2019, section 2.2:
    gradients accumulated over micro-batches, applied once). Call
    ``optimizer.step()`` afterwards, and ``zero_grad()`` before.

    Args:
        table: the schedule of every rank (its length is the world size).
        stage: this rank's part of the model; received activations and
            gradients take the device and dtype of its first parameter
            (CPU float32 for a stage without parameters).
        rank: this process's rank in the default process group.
        inputs: rank 0: the m input micro-batches, ``float [n_i, ...]``.
        targets: last rank: the m target micro-batches (e.g. ``int64 [n_i]``).
        loss_fn: last rank: ``loss_fn(output, target)`` -> scalar tensor.
        forward_sleep_s, backward_sleep_s: seconds to sleep in every forward /
            backward, a stand-in for a long GPU kernel so that two shared CPU
            cores do not distort a bubble measurement.

    Returns:
        :class:`StepResult` of this rank.

    Raises:
        ValueError: the schedule is incomplete, its messages do not match or
            it deadlocks (:class:`DeadlockError`; checked before any message
            is sent, on every rank); the table's length differs from the
            world size or the rank has no stage; inputs missing on rank 0, or
            targets or loss function on the last rank.
    """
    stages = len(table)
    microbatches = max((len({a.microbatch for a in actions}) for actions in table), default=0)
    check_schedule(table, microbatches)
    simulate(table)  # raises DeadlockError before anything would hang
    world = dist.get_world_size() if dist.is_initialized() else 1
    if stages != world:
        raise ValueError(f"the schedule has {stages} stages but the world size is {world}")
    if not 0 <= rank < stages:
        raise ValueError(f"rank {rank} has no stage in a {stages}-stage schedule")
    first, last = rank == 0, rank == stages - 1
    if first and (inputs is None or len(inputs) != microbatches):
        raise ValueError(f"rank 0 needs inputs: a list of {microbatches} micro-batches")
    if last and (targets is None or len(targets) != microbatches or loss_fn is None):
        raise ValueError(f"the last rank needs loss_fn and {microbatches} target micro-batches")
    params = list(stage.parameters())
    device = params[0].device if params else torch.device("cpu")
    dtype = params[0].dtype if params else torch.float32
    total = sum(len(t) for t in targets) if last else 0
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output)
    pending: list = []
    events: list[Event] = []
    peak, loss_sum, sent = 0, 0.0, 0
    for action in table[rank]:
        i = action.microbatch
        if action.kind == "F":
            if first:
                x = inputs[i].to(device)
            else:
                x = _recv(rank - 1, dtype, device).requires_grad_()
            start = _clock(device)
            out = stage(x)
            if last:
                out = loss_fn(out, targets[i].to(device)) * (len(targets[i]) / total)
                loss_sum += out.item()
            held[i] = (x, out)
            peak = max(peak, len(held))
            time.sleep(forward_sleep_s)  # before the send: the output is ready after the "kernel"
            # Stamped before the send is posted, so the next stage, which can only receive
            # after that, never appears to start before this action ended.
            end = _clock(device)
            if not last:
                sent += _send(out, rank + 1, pending)
        else:
            grad = None if last else _recv(rank + 1, dtype, device)
            start = _clock(device)
            x, out = held.pop(i)  # frees micro-batch i's activations after backward
            out.backward(grad)
            time.sleep(backward_sleep_s)
            end = _clock(device)
            if not first:
                sent += _send(x.grad, rank - 1, pending)
        events.append(Event(rank, action, start, end))
    for work, _ in pending:
        work.wait()
    return StepResult(events, peak, loss_sum if last else None, sent)


def gather_timeline(result: StepResult) -> Timeline:
    """Every rank's events in one :class:`Timeline` (a collective: call it on all ranks)."""
    if not dist.is_initialized():
        return Timeline(tuple(result.events))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result.events)
    return Timeline(tuple(e for events in gathered for e in events))
