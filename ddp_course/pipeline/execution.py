"""Running one rank's part of a pipeline schedule for real: stage k of the model on
rank k, activations and gradients passed with point-to-point operations, micro-batch
gradients accumulated so that one pipelined step equals one step on the whole batch;
every action time-stamped, and the stamps of all ranks gathered into a timeline.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .schedules import Schedule, check_schedule
from .simulation import Event, Timeline, simulate


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
