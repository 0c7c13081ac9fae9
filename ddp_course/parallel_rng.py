"""Random numbers under tensor and sequence parallelism: which dropout masks must agree.

Replicated regions hold the same tensor on every tensor-parallel rank, so
their dropout masks must agree; sharded regions (this rank's heads, or its
part of the sequence) hold different elements, so their masks must differ,
and no mask may repeat from step to step. :func:`region_seed` is the seed
rule, :class:`ParallelRNG` the per-rank generator state the course's
tensor- and sequence-parallel models draw their sharded dropout from
(Megatron-LM's RNG tracker), and :func:`dropout_masks` records every mask a
forward draws, so that a test can compare them across ranks and steps.
:mod:`ddp_course.tensor_parallel` and :mod:`ddp_course.sequence_parallel`
re-export these names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn import functional

__all__ = ["ParallelRNG", "dropout_masks", "region_seed"]


def region_seed(seed: int, rank: int, sharded: bool) -> int:
    """The seed for dropout in a replicated (``sharded=False``) or sharded region.

    Replicated regions (the residual branch under plain tensor parallelism)
    hold the same tensor on every tensor-parallel rank, so their dropout
    masks must agree: the same seed on every rank. Sharded regions (this
    rank's heads, or its part of the sequence under sequence parallelism)
    hold different elements, so their masks must differ: an offset per rank.
    Megatron-LM's ``model_parallel_cuda_manual_seed`` uses ``seed + 2718 +
    tp_rank`` for the parallel state. Seed a *state* once with it
    (:class:`ParallelRNG`): re-seeding before every dropout would repeat the
    same mask at every step.
    """
    return seed + 2718 + rank if sharded else seed


class ParallelRNG:
    """The random-number state of the sharded regions of one tensor-parallel rank.

    Megatron-LM's RNG tracker (``tensor_parallel/random.py``,
    ``get_cuda_rng_tracker().fork()``), for CPU and CUDA: a generator state
    seeded once with ``region_seed(seed, rank, sharded=True)``, different on
    every rank. Inside :meth:`fork` the device's default generator draws from
    it; on leaving, the state it reached is kept (so the next step draws new
    numbers) and the default generator gets back its own state, untouched (so
    the replicated regions, drawn from the default generator seeded alike on
    every rank, still agree across the ranks).

    Args:
        seed: the job's seed, the same on every rank (default: the default
            generator's ``torch.initial_seed()``, which ``torch.manual_seed``
            set alike on every rank).
        rank: this rank in the tensor-parallel group. Giving every rank the
            same ``rank`` reproduces the mistake: the same mask on every shard.
    """

    def __init__(self, seed: int | None = None, rank: int = 0):
        self.seed = torch.initial_seed() if seed is None else seed
        self.rank = rank
        self.states: dict[str, torch.Tensor] = {}  # per device, e.g. "cpu", "cuda:0"

    @contextlib.contextmanager
    def fork(self, device: torch.device | str = "cpu") -> Iterator[None]:
        """Draw random numbers on ``device`` from this rank's sharded-region state.

        Raises:
            RuntimeError: ``device`` is a CUDA device and CUDA is not available.
        """
        device = torch.device(device)
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            key = f"cuda:{index}"

            def get() -> torch.Tensor:
                return torch.cuda.get_rng_state(index)

            def put(state: torch.Tensor) -> None:
                torch.cuda.set_rng_state(state, index)
        else:
            key, get, put = "cpu", torch.get_rng_state, torch.set_rng_state
        if key not in self.states:
            gen = torch.Generator(device=key)
            gen.manual_seed(region_seed(self.seed, self.rank, sharded=True))
            self.states[key] = gen.get_state()
        outer = get()
        put(self.states[key])
        try:
            yield
        finally:
            self.states[key] = get()
            put(outer)


@contextlib.contextmanager
def dropout_masks() -> Iterator[list[torch.Tensor]]:
    """Record where every dropout call drops, in call order.

    Wraps ``torch.nn.functional.dropout`` (which ``nn.Dropout`` and
    :class:`ParallelAttention` call; not the dropout inside
    ``scaled_dot_product_attention``). Each call with ``p > 0`` in training
    appends a bool tensor of the input's shape, True where an element is
    dropped: the call is made once on a tensor of ones, the generator's state
    put back, and once on the input, so the recorded mask is the one the
    input gets (even where the input is already zero) and the random stream
    is the same as without recording.
    """
    masks: list[torch.Tensor] = []
    original = functional.dropout

    def recording(input, p=0.5, training=True, inplace=False):
        if not training or p <= 0:
            return original(input, p, training, inplace)
        if input.device.type == "cuda":
            state = torch.cuda.get_rng_state(input.device)
            masks.append(original(torch.ones_like(input), p, True) == 0)
            torch.cuda.set_rng_state(state, input.device)
        else:
            state = torch.get_rng_state()
            masks.append(original(torch.ones_like(input), p, True) == 0)
            torch.set_rng_state(state)
        return original(input, p, training, inplace)

    functional.dropout = recording
    try:
        yield masks
    finally:
        functional.dropout = original
