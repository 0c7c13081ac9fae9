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
``torch.distributed`` point-to-point operations (``batch_isend_irecv``: a send
and the next receive from the same rank in one call, which nccl needs),
micro-batch gradients accumulated so that one pipelined step equals one step
on the whole batch. It time-stamps every action; :func:`gather_timeline`
collects the stamps of all ranks into the same :class:`Timeline`, so the
measurement and the simulation are read the same way.

One idea per module: :mod:`.schedules`, :mod:`.simulation` and :mod:`.execution`;
everything is importable from here.
"""

from .execution import StepResult, gather_timeline, run_schedule, split_microbatches, split_model
from .schedules import (
    SCHEDULES,
    Action,
    check_schedule,
    format_schedule,
    gpipe_bubble,
    gpipe_schedule,
    in_flight,
    naive_schedule,
    one_f_one_b_schedule,
    schedule,
)
from .simulation import DeadlockError, Event, Timeline, simulate

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
