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

from ..collectives import group_rank_and_size
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


_HEADER = 8  # int64 per micro-batch: number of dimensions, then the shape


def _meta_shapes(stage: nn.Module, shapes: list, dtype: torch.dtype) -> list[torch.Size]:
    """The output shape of ``stage`` for each input shape, from a forward on meta tensors.

    Meta tensors carry shapes and dtypes and no data, so this costs no arithmetic;
    ``torch.distributed.pipelining`` sizes its receive buffers the same way.
    """
    state = {name: torch.empty_like(t, device="meta") for name, t in stage.named_parameters()}
    state |= {name: torch.empty_like(t, device="meta") for name, t in stage.named_buffers()}
    with torch.no_grad():
        return [
            torch.func.functional_call(
                stage, state, (torch.empty(shape, dtype=dtype, device="meta"),)
            ).shape
            for shape in shapes
        ]


def _exchange_shapes(first: bool, last: bool, rank: int, in_shapes, stage, dtype, device):
    """Shapes of the activations this rank receives and sends, micro-batch by micro-batch.

    Down the chain of stages before the first action: rank k receives the shapes
    of its inputs from rank k-1, finds its outputs' on meta tensors and sends them
    to rank k+1 (one int64 ``[m, 8]`` tensor each way), so that every later
    receive is posted with its buffer ready, in the same call as a send.
    """
    if not first:
        header = torch.empty(len(in_shapes), _HEADER, dtype=torch.int64, device=device)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, rank - 1)]))
        in_shapes = [torch.Size(row[1 : 1 + row[0]]) for row in header.tolist()]
    out_shapes = [] if last else _meta_shapes(stage, in_shapes, dtype)
    if not last:
        if max(len(shape) for shape in out_shapes) >= _HEADER:
            raise ValueError(f"pipeline messages support at most {_HEADER - 1} dimensions")
        rows = [[len(shape), *shape] + [0] * (_HEADER - 1 - len(shape)) for shape in out_shapes]
        header = torch.tensor(rows, dtype=torch.int64, device=device)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, header, rank + 1)]))
    return in_shapes, out_shapes


def _wait(works) -> None:
    for work in works:
        work.wait()


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` once this stream's queued kernels are done (CUDA runs async).

    Only the current stream: a send still running on NCCL's own stream is not waited
    for here (it is at the end of the step), as :func:`simulate` models sends.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
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

    Every message goes through ``dist.batch_isend_irecv``. A send is posted in the
    same call as the next action's receive when both are with the same rank (in
    1F1B, F(i)'s output with B(j)'s gradient, B(j)'s gradient with F(i+1)'s input),
    as ``torch.distributed.pipelining`` does: with nccl a send may wait until its
    peer posts the receive, and two ranks that each sent first would wait for each
    other; one call runs both directions at once. Receive buffers are sized
    beforehand (the shapes travel down the chain once, found on meta tensors).
    The host waits for a receive before the action that needs it and for the
    sends at the end (with gloo; with nccl a wait orders the stream), so the run
    follows :func:`simulate`'s semantics, and a schedule that simulates without
    deadlock runs without one.

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
            targets or loss function on the last rank; a message of 8 or more
            dimensions, or a stage whose output shape differs from the one its
            meta forward gave (data-dependent shapes are not supported).
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
    in_shapes, out_shapes = _exchange_shapes(
        first,
        last,
        rank,
        [x.shape for x in inputs] if first else [None] * microbatches,
        stage,
        inputs[0].dtype if first else dtype,
        device,
    )

    def incoming(action):
        """(peer, buffer shape) of the message ``action`` waits for, or None."""
        if action.kind == "F" and not first:
            return rank - 1, in_shapes[action.microbatch]
        if action.kind == "B" and not last:
            return rank + 1, out_shapes[action.microbatch]
        return None

    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output)
    pending: list = []  # (works, tensor): sends, awaited at the end of the step
    early = None  # (works, buffer) of the next action's receive, posted with the last send
    events: list[Event] = []
    peak, loss_sum, sent = 0, 0.0, 0
    actions = table[rank]
    for index, action in enumerate(actions):
        i = action.microbatch
        need = incoming(action)
        received = None
        if need is not None:
            if early is None:
                received = torch.empty(need[1], dtype=dtype, device=device)
                _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, need[0])]))
            else:
                works, received = early
                _wait(works)
                early = None
        if action.kind == "F":
            x = inputs[i].to(device) if first else received.requires_grad_()
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
            message, peer = (None, None) if last else (out, rank + 1)
            if message is not None and message.shape != out_shapes[i]:
                raise ValueError(
                    f"stage {rank}'s output for micro-batch {i} has shape {tuple(out.shape)}, "
                    f"its meta forward gave {tuple(out_shapes[i])}"
                )
        else:
            start = _clock(device)
            x, out = held.pop(i)  # frees micro-batch i's activations after backward
            out.backward(received)
            time.sleep(backward_sleep_s)
            end = _clock(device)
            message, peer = (None, None) if first else (x.grad, rank - 1)
        events.append(Event(rank, action, start, end))
        if message is None:
            continue
        payload = message.detach().contiguous()
        sent += payload.numel() * payload.element_size()
        ops = [dist.P2POp(dist.isend, payload, peer)]
        following = incoming(actions[index + 1]) if index + 1 < len(actions) else None
        if following is not None and following[0] == peer:
            buffer = torch.empty(following[1], dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, peer))
        works = dist.batch_isend_irecv(ops)
        if len(ops) == 1:
            pending.append((works, payload))
        elif len(works) == len(ops):  # one work per op (gloo): wait for the receive only
            early = ([works[1]], buffer)
            pending.append(([works[0]], payload))
        else:  # one work for the call (nccl): waiting orders the stream after both
            early = (works, buffer)
            pending.append(([], payload))
    for works, _ in pending:
        _wait(works)
    return StepResult(events, peak, loss_sum if last else None, sent)


def gather_timeline(result: StepResult) -> Timeline:
    """Every rank's events in one :class:`Timeline` (a collective: call it on all ranks)."""
    _, world = group_rank_and_size()
    if world == 1:
        return Timeline(tuple(result.events))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result.events)
    return Timeline(tuple(e for events in gathered for e in events))
