"""DistributedDataParallel from scratch: what ``torch.nn.parallel.DistributedDataParallel`` does.

Three steps, each a drop-in for the one before:

- :func:`average_gradients`: after ``loss.backward()``, all-reduce every
  ``.grad`` and divide by the world size (the loop of PyTorch's tutorial
  "Writing Distributed Applications with PyTorch").
- :class:`NaiveDDP`: a wrapper that broadcasts rank 0's parameters and buffers
  at construction and all-reduces each gradient, one call per parameter, the
  moment autograd has accumulated it, while backward still runs.
- :class:`BucketedDDP`: gradients packed into flat buckets in reverse
  parameter order; a bucket is all-reduced asynchronously as soon as its last
  gradient is ready; ``no_sync()``, frozen, tied and unused parameters, buffer
  broadcast before forward; torch DDP's interface (``.module``).

Sources: PyTorch's DDP design note
(https://pytorch.org/docs/stable/notes/ddp.html) and S. Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020
(https://arxiv.org/abs/2006.15704), sections 3.2 (bucketing, overlap, the
order of buckets, unused parameters) and 3.2.4 (``no_sync``).

What "waits" means depends on the backend. With gloo (CPU), ``work.wait()``
blocks the calling thread until the all-reduce has finished, so when
``loss.backward()`` returns the averaged gradients are in ``.grad``. With
nccl (CUDA), ``work.wait()`` makes the current CUDA stream wait for the
collective and returns at once: the host goes on, and every kernel queued on
that stream afterwards (the copy into ``.grad``, the optimizer step) runs after
the all-reduce; only a host read (``.item()``, ``.cpu()``,
``torch.cuda.synchronize()``) waits for the values. torch's DDP behaves the
same way.

Every process must build the same model and run forward and backward the same
number of times; the ranks call collectives in the same order because the
buckets are launched in a fixed order (bucket ``i`` never before bucket
``i - 1``), as torch's reducer does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .runtime import require_group

__all__ = [
    "BucketedDDP",
    "NaiveDDP",
    "average_gradients",
    "broadcast_state",
    "check_same_shapes",
]


def average_gradients(model: nn.Module, group: Any = None) -> None:
    """All-reduce every parameter's ``.grad`` and divide by the world size, in place.

    Call it between ``loss.backward()`` and ``optimizer.step()``. One blocking
    all-reduce per parameter, after backward has finished: correct, but no
    overlap of communication with computation.

    Args:
        model: any module; parameters whose ``.grad`` is ``None`` (frozen or
            unused) are skipped, so every rank must have the same ones set.
        group: process group (default: the world).

    Raises:
        RuntimeError: if no process group exists.
    """
    group = require_group(group, "averaging gradients")
    world_size = dist.get_world_size(group)
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            param.grad /= world_size


def check_same_shapes(module: nn.Module, group: Any) -> None:
    """Raise ValueError on every rank if some rank's parameters differ in name, shape or
    dtype (one ``all_gather_object``; every rank of ``group`` must call it)."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        diff = [(a, b) for a, b in zip(everyone[0], theirs) if a != b]
        where = diff[0] if diff else (f"{len(everyone[0])} parameters", f"{len(theirs)}")
        raise ValueError(
            f"rank {rank}'s model differs from rank 0's: {where[1]} against {where[0]} "
            "(name, shape, dtype). Build the same model on every rank."
        )


def broadcast_state(module: nn.Module, group: Any) -> None:
    """Copy the parameters and buffers of ``group``'s rank 0 to every rank, in place (one
    broadcast per tensor; every rank of ``group`` must call it)."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=src, group=group)


def _queue_final_callback(callback) -> None:
    # The autograd engine runs queued callbacks once the whole backward pass
    # has finished; torch's DDP waits for its buckets the same way.
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class NaiveDDP(nn.Module):
    """Per-parameter DDP: one asynchronous all-reduce per gradient, launched from its hook.

    At construction rank 0's parameters and buffers are broadcast. A
    ``register_post_accumulate_grad_hook`` on every trainable parameter starts
    ``all_reduce(p.grad / world_size)`` as soon as autograd has written
    ``p.grad``; a callback queued on the autograd engine calls ``wait()`` on
    all of them. With gloo that blocks until they are done, so when
    ``loss.backward()`` returns every ``.grad`` holds the average over ranks;
    with nccl it orders the current CUDA stream after them and the host goes
    on, so every later kernel on that stream sees the average (module
    docstring). float32/float16/bfloat16 on CPU with gloo or on CUDA with nccl.
    Many small messages: the latency of each call adds up, which
    is why torch's DDP buckets them (design note, "Gradient bucketing").

    Args:
        module: the model, already on this rank's device. Available as ``.module``.
        process_group: group to average over (default: the world).

    Raises:
        RuntimeError: no process group; in backward, a trainable parameter got
            no gradient (named in the message; use :class:`BucketedDDP` with
            ``find_unused_parameters=True``).
        ValueError: parameters differ in name, shape or dtype across ranks.
    """

    def __init__(self, module: nn.Module, process_group: Any = None):
        super().__init__()
        self.process_group = require_group(process_group, "DDP")
        self.world_size = dist.get_world_size(self.process_group)
        self.module = module
        check_same_shapes(module, self.process_group)
        broadcast_state(module, self.process_group)
        self._names = {p: n for n, p in module.named_parameters() if p.requires_grad}
        self._handles: list[tuple[nn.Parameter, Any]] = []
        self._queued = False
        for param in self._names:
            param.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _hook(self, param: nn.Parameter) -> None:
        if not self._queued:
            self._queued = True
            _queue_final_callback(self._finish)
        param.grad.div_(self.world_size)  # average = sum of grad / world_size
        work = dist.all_reduce(param.grad, group=self.process_group, async_op=True)
        self._handles.append((param, work))

    def _finish(self) -> None:
        for _, work in self._handles:
            work.wait()
        done = {p for p, _ in self._handles}
        self._handles, self._queued = [], False
        missing = [name for p, name in self._names.items() if p not in done]
        if missing:
            raise RuntimeError(
                f"NaiveDDP: parameters {missing} got no gradient in this backward pass, "
                "so the ranks would stop calling the same collectives. Use them in "
                "forward, freeze them (requires_grad=False), or use "
                "BucketedDDP(..., find_unused_parameters=True)."
            )


class _Bucket:
    """A flat gradient buffer for parameters of one dtype and device (reverse order)."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.nbytes = total * self.buffer.element_size()
        # Views into the flat buffer, made once: slicing every step costs time.
        self.views = [
            self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, params)
        ]
        self.ready: set[nn.Parameter] = set()
        self.work: Any = None

    def view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot in the buffer, shaped like the parameter."""
        return self.views[i]


class BucketedDDP(nn.Module):
    """DDP with gradient buckets, overlap of all-reduce with backward, and ``no_sync()``.

    What torch's ``DistributedDataParallel`` does (design note; Li et al.,
    VLDB 2020, section 3.2), in Python:

    - construction: check that every rank has the same parameters, broadcast
      rank 0's parameters and buffers, and pack the trainable parameters (tied
      ones once, frozen ones not at all) into buckets in reverse registration
      order, roughly the order in which backward produces their gradients. A
      bucket closes once it holds ``bucket_cap_mb`` megabytes or more
      (2**20 bytes to a megabyte, as torch counts them), so a cap smaller
      than every parameter gives one bucket per parameter; a new dtype or
      device also starts a new bucket.
    - forward: broadcast rank 0's buffers first (``broadcast_buffers``), as
      torch does when the previous forward was a synchronised one.
    - backward: a post-accumulate-grad hook copies each gradient into its
      bucket; when a bucket is full and all buckets before it are launched,
      ``all_reduce(bucket / world_size)`` starts asynchronously. A callback
      queued on the autograd engine calls ``wait()`` on every bucket and
      copies the averages back into ``.grad``. With gloo ``wait()`` blocks, so
      the averages are in ``.grad`` when ``loss.backward()`` returns; with
      nccl it makes the current CUDA stream wait for the all-reduce and the
      host goes on: the copies and the optimizer step are queued behind it.
    - ``no_sync()``: the backward of a forward run inside it communicates
      nothing and gradients accumulate locally in ``.grad``; the first
      backward of a forward outside it averages the sum. Like torch, the
      forward decides: a forward outside ``no_sync()`` followed by a backward
      inside it still synchronises.

    Unused parameters (no gradient in a backward): with
    ``find_unused_parameters=True`` their bucket slot counts as zero, and one
    extra all-reduce of a "used" flag per parameter tells whether any rank
    used it; if none did, its ``.grad`` is left as it was, like torch. With
    ``False`` (the default) backward raises an error that names them.

    Attributes:
        module: the wrapped model.
        buckets: list of :class:`_Bucket`; ``bucket_names()`` gives their
            parameter names, ``bucket_bytes()`` their sizes in bytes.
        events: timestamps (``time.perf_counter()`` seconds) of the last
            synchronised backward: ``("grad", name, t)`` when a gradient was
            ready, ``("launch", i, t)`` and ``("done", i, t)`` per bucket all-reduce
            (``done`` from the all-reduce future's completion callback),
            ``("end", None, t)`` when the callback had finished. Host times:
            on CUDA a hook runs when autograd queued the gradient's kernels,
            and nccl completes the future once later kernels may use the
            result, not when the GPU has finished the all-reduce.

    Args:
        module: the model, on this rank's device.
        bucket_cap_mb: bucket capacity in megabytes (> 0); torch's default 25.
        process_group: group to average over (default: the world).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm running
            statistics) before each synchronised forward.
        find_unused_parameters: handle parameters that get no gradient.
        overlap: launch a bucket's all-reduce during backward as soon as it
            is full (True, as torch does) or all of them after backward
            (False, to see what overlap buys).

    Raises:
        ValueError: ``bucket_cap_mb <= 0``; parameters differ across ranks.
        RuntimeError: no process group; in backward, a parameter got no
            gradient and ``find_unused_parameters`` is False; a gradient
            arrived twice in one backward.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        process_group: Any = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        overlap: bool = True,
    ):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 megabytes, got {bucket_cap_mb}")
        self.process_group = require_group(process_group, "DDP")
        self.world_size = dist.get_world_size(self.process_group)
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.overlap = overlap
        self.require_backward_grad_sync = True
        self._sync_buffers_next_forward = True
        self._sync_backward = True
        check_same_shapes(module, self.process_group)
        broadcast_state(module, self.process_group)
        # named_parameters() yields a tied parameter once, under its first name.
        self._names = {p: n for n, p in module.named_parameters() if p.requires_grad}
        self.buckets = self._make_buckets(list(self._names)[::-1], bucket_cap_mb * 2**20)
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next_launch = 0
        self._queued = False
        self.events: list[tuple[str, Any, float]] = []
        self._pending_events: list[tuple[str, Any, float]] = []
        for param in self._names:
            param.register_post_accumulate_grad_hook(self._hook)

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = []
        size = 0.0
        for p in params:
            kind = (p.dtype, p.device)
            if (
                not groups
                or size >= cap_bytes
                or kind != (groups[-1][0].dtype, groups[-1][0].device)
            ):
                groups.append([])
                size = 0.0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        return [_Bucket(i, g) for i, g in enumerate(groups)]

    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[p] for p in b.params] for b in self.buckets]

    def bucket_bytes(self) -> list[int]:
        """Size of each bucket in bytes, in launch order."""
        return [b.nbytes for b in self.buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._sync_buffers_next_forward:
            src = dist.get_global_rank(self.process_group, 0)
            with torch.no_grad():
                for buf in self.module.buffers():
                    dist.broadcast(buf, src=src, group=self.process_group)
        out = self.module(*args, **kwargs)
        # As in torch, the forward decides: a forward inside no_sync() gives a
        # backward without communication, wherever that backward is called.
        self._sync_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._sync_buffers_next_forward = self._sync_backward
        return out

    def _hook(self, param: nn.Parameter) -> None:
        if not self._sync_backward:
            return  # no_sync(): the gradient stays in param.grad and accumulates
        now = time.perf_counter()
        if not self._queued:
            self._queued = True
            self._pending_events = []
            _queue_final_callback(self._finish)
        bucket, i = self._where[param]
        if param in bucket.ready:
            raise RuntimeError(
                f"BucketedDDP: {self._names[param]} got a gradient twice in one backward "
                "pass (reentrant backward or a second backward before the first ended)"
            )
        bucket.view(i).copy_(param.grad)
        bucket.ready.add(param)
        self._pending_events.append(("grad", self._names[param], now))
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch in bucket order only: every rank must call the same
        # collectives in the same order (Li et al., section 3.2.3).
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.buffer.div_(self.world_size)
        self._pending_events.append(("launch", bucket.index, time.perf_counter()))
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        events, index = self._pending_events, bucket.index
        # When the reduction really completed, seen from gloo's/nccl's side.
        bucket.work.get_future().add_done_callback(
            lambda _: events.append(("done", index, time.perf_counter()))
        )
        self._next_launch += 1

    def _finish(self) -> None:
        unused = [p for b in self.buckets for p in b.params if p not in b.ready]
        if unused and not self.find_unused_parameters:
            for bucket in self.buckets[: self._next_launch]:
                bucket.work.wait()  # every rank launched these; finish them cleanly
            self._reset()
            names = [self._names[p] for p in unused]
            raise RuntimeError(
                f"BucketedDDP: parameters {names} got no gradient in this backward pass. "
                "Use every parameter in forward, freeze the unused ones "
                "(requires_grad=False), or pass find_unused_parameters=True."
            )
        used = None
        if self.find_unused_parameters:
            for p in unused:  # a zero contribution from this rank
                bucket, i = self._where[p]
                bucket.view(i).zero_()
                bucket.ready.add(p)
        self._launch_ready()  # the rest (all of them when overlap=False)
        if self.find_unused_parameters:
            params = list(self._where)
            missing = set(unused)  # tensors hash by identity
            used = torch.tensor([float(p not in missing) for p in params])
            used = used.to(self.buckets[0].buffer.device)
            dist.all_reduce(used, group=self.process_group)
            used = {p for p, flag in zip(params, used.tolist()) if flag > 0}
        for bucket in self.buckets:
            # gloo: blocks until reduced. nccl: the current stream waits for
            # the all-reduce; the copies below are queued after it.
            bucket.work.wait()
            for i, p in enumerate(bucket.params):
                if used is not None and p not in used:
                    continue  # no rank used it: leave .grad alone, as torch does
                if p.grad is None:
                    p.grad = bucket.view(i).clone()
                else:
                    p.grad.copy_(bucket.view(i))
        self._pending_events.append(("end", None, time.perf_counter()))
        self.events = self._pending_events
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
        self._next_launch = 0
        self._queued = False
