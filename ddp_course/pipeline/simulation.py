"""Simulating a pipeline schedule with blocking point-to-point semantics: a deadlock,
named rank by rank, or a timeline of start and end times that gives the bubble and the
peak number of in-flight micro-batches, drawn as a text Gantt chart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .schedules import Action, Schedule, in_flight


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
