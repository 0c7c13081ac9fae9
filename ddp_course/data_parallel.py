"""Data parallelism from scratch.

:class:`DataParallel` is ``torch.nn.DataParallel``'s algorithm written out in
four functions that run anywhere, CPU included: one process, one replica of
the model per device (or per worker thread on a CPU), every step

1. :func:`scatter` splits the batch along dimension 0, one chunk per replica;
2. :func:`replicate` copies the module onto every device, through an
   autograd function whose backward sums the replicas' gradients onto the
   original parameters (the parameter-server pattern, with the first device
   as the server);
3. :func:`parallel_apply` runs each replica on its chunk in its own thread;
4. :func:`gather` concatenates the outputs on the output device.

The loss is then computed on the gathered outputs and ``loss.backward()``
fills ``module.parameters()``'s ``.grad`` with the gradient of the whole
batch, so an optimizer steps exactly as on one device.

Sources: ``torch.nn.DataParallel``
(https://pytorch.org/docs/stable/generated/torch.nn.DataParallel.html) and
its parts in ``torch/nn/parallel/`` (``scatter_gather.py``,
``replicate.py``, ``parallel_apply.py``, ``_functions.py``); why PyTorch
recommends DDP instead:
https://pytorch.org/docs/stable/notes/cuda.html#use-nn-parallel-distributeddataparallel-instead-of-multiprocessing-or-nn-dataparallel.

Devices follow the course's rule (:func:`ddp_course.runtime.replica_devices`):
one GPU per replica when every replica can have its own, otherwise every
replica on the CPU as a thread; :func:`ddp_course.replica_plan.plan_replicas`
adds the choice between torch's wrapper and this one. Clocks read by :func:`clock` wait for the GPUs
first, because CUDA kernels run asynchronously.

Data parallelism across processes, DDP written from scratch (a naive and a
bucketed version with DDP's ``no_sync()``), is lesson 07's, in ``ddp_course.ddp``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import runtime

__all__ = [
    "DataParallel",
    "clock",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
]


def clock(devices: Iterable[torch.device | str] = ()) -> float:
    """``time.perf_counter()`` in seconds, read after every CUDA device in ``devices``
    has finished its queued work.

    A CUDA kernel call returns as soon as the kernel is queued, so a clock read
    right after it measures the launch, not the work. ``torch.cuda.synchronize``
    waits for one device only (the current one by default), hence one call per
    distinct GPU. CPU devices need no wait.
    """
    for device in dict.fromkeys(torch.device(d) for d in devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter()


def _batch_sizes(obj: Any, dim: int) -> list[int]:
    if isinstance(obj, torch.Tensor):
        return [obj.shape[dim]] if obj.dim() > dim else []
    if isinstance(obj, (list, tuple)):
        return [size for item in obj for size in _batch_sizes(item, dim)]
    if isinstance(obj, Mapping):
        return [size for item in obj.values() for size in _batch_sizes(item, dim)]
    return []


def _split(obj: Any, devices: Sequence[torch.device], dim: int) -> list[Any]:
    n = len(devices)
    if isinstance(obj, torch.Tensor) and obj.dim() > dim:
        # tensor_split gives exactly n chunks whose sizes differ by at most
        # one (10 -> 4, 3, 3); torch's scatter uses chunk(), which can give
        # fewer chunks than devices (6 over 4 -> 2, 2, 2).
        return [c.to(d) for c, d in zip(torch.tensor_split(obj, n, dim), devices, strict=True)]
    if isinstance(obj, (list, tuple)) and obj:
        per_item = [_split(item, devices, dim) for item in obj]
        return [type(obj)(parts) for parts in zip(*per_item, strict=True)]
    if isinstance(obj, Mapping) and obj:
        per_key = {k: _split(v, devices, dim) for k, v in obj.items()}
        return [{k: v[i] for k, v in per_key.items()} for i in range(n)]
    # Anything that is not a tensor (a flag, a string) goes to every replica.
    return [obj] * n


def scatter(
    inputs: tuple,
    kwargs: dict | None,
    devices: Sequence[torch.device],
    dim: int = 0,
) -> list[tuple[tuple, dict]]:
    """Split a batch into one chunk per device: step 1 of data parallelism.

    Every tensor in ``inputs`` and ``kwargs`` (nested in tuples, lists and
    dicts too) is cut into ``len(devices)`` chunks along ``dim`` with
    ``torch.tensor_split`` and moved to its device; other values are passed
    to every replica unchanged. Moving is differentiable, so gradients flow
    back to the input on GPUs.

    Args:
        inputs: positional arguments of the forward pass, e.g. ``(x,)`` with
            ``x`` of shape ``[B, ...]``.
        kwargs: keyword arguments of the forward pass, or ``None``.
        devices: one device per replica (repeat ``cpu`` for CPU threads).
        dim: the batch dimension.

    Returns:
        ``len(devices)`` pairs ``(args, kwargs)``; chunk ``i`` has
        ``B // n + (1 if i < B % n else 0)`` samples, on ``devices[i]``.

    Raises:
        ValueError: if there are no devices, no tensor with a batch
            dimension, tensors whose batch sizes differ, or fewer samples
            than devices (a replica would get an empty chunk).
    """
    kwargs = kwargs or {}
    if not devices:
        raise ValueError("scatter needs at least one device")
    sizes = set(_batch_sizes((inputs, kwargs), dim))
    if not sizes:
        raise ValueError(f"no input tensor has a dimension {dim} to split")
    if len(sizes) > 1:
        raise ValueError(f"input tensors differ in size along dimension {dim}: {sorted(sizes)}")
    batch = sizes.pop()
    if batch < len(devices):
        raise ValueError(
            f"a batch of {batch} cannot be split over {len(devices)} replicas: each needs "
            f"at least one sample; use a batch of at least {len(devices)} or fewer replicas"
        )
    args_chunks = _split(tuple(inputs), devices, dim)
    kwargs_chunks = _split(dict(kwargs), devices, dim) if kwargs else [{}] * len(devices)
    return list(zip(args_chunks, kwargs_chunks, strict=True))


class _Broadcast(torch.autograd.Function):
    """Copy tensors to every device; backward sums the copies' gradients.

    The same pair as torch's ``Broadcast`` / ``ReduceAddCoalesced`` in
    ``torch/nn/parallel/_functions.py``: forward is the parameter server
    sending the weights, backward is the workers sending their gradients
    back and the server adding them up.
    """

    @staticmethod
    def forward(ctx, devices, timings, *tensors):
        ctx.num_tensors = len(tensors)
        ctx.sources = [t.device for t in tensors]
        ctx.devices = [*ctx.sources, *devices]
        ctx.timings = timings
        # A real copy for every replica, the first included (torch skips the
        # copy on the source device); on a CPU this is the replication cost.
        return tuple(t.to(d, copy=True) for d in devices for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        start = clock(ctx.devices) if ctx.timings is not None else 0.0
        n = ctx.num_tensors
        summed = []
        for i, source in enumerate(ctx.sources):
            total = grads[i].to(source, copy=True)
            for g in grads[i + n :: n]:
                total += g.to(source)
            summed.append(total)
        if ctx.timings is not None:
            ctx.timings["reduce"] = clock(ctx.devices) - start
        return (None, None, *summed)


def _shallow_copy(module: nn.Module) -> nn.Module:
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    # New dicts, so that filling in the replica's tensors and children
    # leaves the original module untouched.
    replica._parameters = dict(module._parameters)
    replica._buffers = dict(module._buffers)
    replica._modules = dict(module._modules)
    return replica


def replicate(
    module: nn.Module,
    devices: Sequence[torch.device],
    timings: dict[str, float] | None = None,
) -> list[nn.Module]:
    """Copy ``module`` onto each device: step 2 of data parallelism.

    Each replica is a shallow copy of every submodule whose parameters are
    outputs of :class:`_Broadcast`: tensors with a ``grad_fn``, not leaves.
    Backpropagating through a replica therefore accumulates the gradient
    onto the *original* parameters, summed over replicas. Parameters shared
    between submodules (tied weights) stay shared within each replica.

    Buffers (BatchNorm running statistics) are not differentiated: the
    first replica shares the original buffers and the others get copies,
    as in torch, so only the first replica's updates survive the step.

    Args:
        module: the model, on ``devices[0]``.
        devices: one device per replica.
        timings: if given, ``timings["reduce"]`` receives the seconds the
            backward pass spends summing the replicas' gradients.

    Returns:
        ``len(devices)`` modules; replica ``i`` lives on ``devices[i]``.
    """
    params = list(module.parameters())
    copies = _Broadcast.apply(list(devices), timings, *params) if params else ()
    index = {id(p): i for i, p in enumerate(params)}
    modules = list(module.modules())
    replicas = []
    for r, device in enumerate(devices):
        mine = copies[r * len(params) : (r + 1) * len(params)]
        twins = {id(m): _shallow_copy(m) for m in modules}
        for m in modules:
            twin = twins[id(m)]
            for name, child in m._modules.items():
                twin._modules[name] = None if child is None else twins[id(child)]
            for name, p in m._parameters.items():
                twin._parameters[name] = None if p is None else mine[index[id(p)]]
            if r > 0:
                for name, b in m._buffers.items():
                    twin._buffers[name] = None if b is None else b.to(device, copy=True)
        replicas.append(twins[id(module)])
    return replicas


def parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[tuple[tuple, dict]],
    threads: bool = True,
) -> list[Any]:
    """Run ``replicas[i](*args_i, **kwargs_i)`` for every i: step 3.

    One Python thread per replica, as in torch. A thread holds the GIL while
    it runs Python code (module calls, hooks) and releases it inside
    PyTorch's kernels, so threads overlap only in the kernels. Grad mode is
    per thread in PyTorch, so each thread inherits the caller's.

    On CPU the autograd engine later runs the whole backward pass in the
    thread that calls ``backward()``, so only the forward pass is parallel
    here; on GPUs the engine has one worker thread per device.

    Args:
        replicas: from :func:`replicate`.
        inputs: from :func:`scatter`, one ``(args, kwargs)`` per replica.
        threads: ``False`` runs the replicas one after another in the
            calling thread (to measure what the threads buy).

    Returns:
        The replicas' outputs, in replica order.

    Raises:
        ValueError: if there are not as many inputs as replicas.
        RuntimeError: a replica raised; the message names the replica and
            the original exception is chained.
    """
    if len(replicas) != len(inputs):
        raise ValueError(f"{len(replicas)} replicas but {len(inputs)} inputs")
    grad_enabled = torch.is_grad_enabled()
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)

    def work(i: int) -> None:
        try:
            param = next(replicas[i].parameters(), None)
            # A thread starts on the default GPU; kernels must go to the replica's.
            on_gpu = param is not None and param.is_cuda
            with (
                torch.set_grad_enabled(grad_enabled),
                torch.cuda.device(param.device if on_gpu else -1),
            ):
                args, kwargs = inputs[i]
                results[i] = replicas[i](*args, **kwargs)
        except BaseException as exc:  # handed to the caller below
            errors[i] = exc

    if threads and len(replicas) > 1:
        workers = [
            threading.Thread(target=work, args=(i,), name=f"replica-{i}")
            for i in range(len(replicas))
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        for i in range(len(replicas)):
            work(i)
    for i, exc in enumerate(errors):
        if exc is not None:
            raise RuntimeError(f"replica {i} raised {type(exc).__name__}: {exc}") from exc
    return results


def gather(outputs: Sequence[Any], output_device: torch.device, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs on ``output_device``: step 4.

    Tensors ``[b_i, ...]`` become one ``[sum b_i, ...]`` tensor, in replica
    order, so row ``j`` of the result belongs to sample ``j`` of the batch.
    Tuples, lists and dicts of tensors are gathered element by element.
    Differentiable: the backward pass sends each replica its rows.

    Raises:
        ValueError: if ``outputs`` is empty or its elements differ in type.
    """
    if not outputs:
        raise ValueError("nothing to gather")
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([o.to(output_device) for o in outputs], dim)
    if isinstance(first, (list, tuple)):
        return type(first)(
            gather(parts, output_device, dim) for parts in zip(*outputs, strict=True)
        )
    if isinstance(first, Mapping):
        return {k: gather([o[k] for o in outputs], output_device, dim) for k in first}
    raise ValueError(f"cannot gather outputs of type {type(first).__name__}")


def _with_index(device: torch.device) -> torch.device:
    # "cuda" means the current GPU; tensors always report "cuda:<index>".
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DataParallel(nn.Module):
    """Single-process data parallelism over devices or CPU threads, from scratch.

    A drop-in for ``torch.nn.DataParallel`` that also runs on a CPU, where
    torch's version calls the module directly. Every forward pass does
    scatter, replicate, parallel_apply and gather (see the module
    docstring); ``loss.backward()`` on the gathered output leaves the
    whole-batch gradient in ``self.module``'s parameters.

    Gradients equal one device's on the whole batch for models whose
    samples are independent (no BatchNorm: each replica normalises with
    its own chunk's statistics) and without random layers in training mode
    (dropout draws from one generator shared by the threads, in whatever
    order they run).

    Args:
        module: the model, on ``devices[0]``.
        num_replicas: replicas when ``devices`` is not given; default: one
            per GPU, or 2 without GPUs.
        devices: one device per replica; may repeat a device
            (``[cpu, cpu]`` is two threads on the CPU). Default:
            ``runtime.replica_devices(num_replicas, runtime.gpu_count())``,
            the course's rule: ``cuda:0`` .. ``cuda:n-1`` when there are at
            least ``n`` GPUs, else ``n`` CPU threads (a GPU is never shared
            by two replicas). Put ``module`` on the first of them.
        output_device: where outputs are gathered; default ``devices[0]``.
        dim: the batch dimension of inputs and outputs.
        threads: run replicas in threads (``False``: one after another).

    Attributes:
        timings: seconds spent in each step of the last forward pass
            (``scatter``, ``replicate``, ``parallel_apply``, ``gather``) and,
            after its backward pass, ``reduce``; read with :func:`clock`, so
            on GPUs each is the time of the work, not of queueing it.

    Raises:
        ValueError: on ``num_replicas < 1``, ``num_replicas`` that
            contradicts ``devices``, or a module that is not on
            ``devices[0]``; in forward, on a batch smaller than the number
            of replicas.

    The state dict keys start with ``module.``, as torch's wrapper's do;
    save ``self.module.state_dict()`` (see :mod:`ddp_course.checkpoint`).
    """

    def __init__(
        self,
        module: nn.Module,
        num_replicas: int | None = None,
        devices: Sequence[torch.device | str] | None = None,
        output_device: torch.device | str | None = None,
        dim: int = 0,
        threads: bool = True,
    ):
        super().__init__()
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
        if devices is None:
            # Read through the module so that tests can play 0, 1, 2 or 4 GPUs.
            devices = runtime.replica_devices(num_replicas, runtime.gpu_count())
        devices = [_with_index(torch.device(d)) for d in devices]
        if not devices:
            raise ValueError("devices is empty")
        if num_replicas is not None and num_replicas != len(devices):
            raise ValueError(f"num_replicas={num_replicas} but {len(devices)} devices given")
        for t in [*module.parameters(), *module.buffers()]:
            if t.device != devices[0]:
                raise ValueError(
                    f"the module must be on devices[0] = {devices[0]}, found a tensor on "
                    f"{t.device}; call module.to({str(devices[0])!r}) first"
                )
        self.module = module
        self.devices = devices
        self.output_device = torch.device(output_device) if output_device else devices[0]
        self.dim = dim
        self.threads = threads
        self.timings: dict[str, float] = {}

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        timings: dict[str, float] = {}
        # Every clock waits for the GPUs (see clock): each part's time is its work.
        devices = [*self.devices, self.output_device]
        t0 = clock(devices)
        chunks = scatter(inputs, kwargs, self.devices, self.dim)
        t1 = clock(devices)
        replicas = replicate(self.module, self.devices, timings)
        t2 = clock(devices)
        outputs = parallel_apply(replicas, chunks, self.threads)
        t3 = clock(devices)
        out = gather(outputs, self.output_device, self.dim)
        t4 = clock(devices)
        timings.update(scatter=t1 - t0, replicate=t2 - t1, parallel_apply=t3 - t2, gather=t4 - t3)
        self.timings = timings
        return out

    def extra_repr(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, threads={self.threads}"
