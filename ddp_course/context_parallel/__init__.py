"""Context parallelism: attention over a sequence split across ranks (notebook 15).

Each rank holds ``T_local`` consecutive (or zig-zag placed) tokens of one long
sequence: its queries, keys and values are ``[B, heads, T_local, head_dim]``.
Attention needs every query against every key, so the ranks exchange keys and
values. Three ways are written from scratch:

- **Ring attention** (:func:`ring_attention`; Liu, Zaharia and Abbeel, "Ring
  Attention with Blockwise Transformers for Near-Infinite Context", 2023,
  section 3). Key/value chunks travel around a ring of ranks with
  point-to-point sends, each pass posted before the current chunk's compute and
  waited for after it (:class:`RingPass`); each rank attends its queries to the
  chunk it holds and merges the partial results with their log-sum-exp
  (:func:`merge_partials`: the online softmax of Milakov and Gimelshein, 2018,
  used by FlashAttention, Dao et al. 2022, section 3.1). The backward pass sends
  the keys and values around again with their gradient accumulators
  (FlashAttention-2's backward, Dao 2023, algorithm 2, one block at a time).
- **Zig-zag placement** (:func:`sequence_segments` with ``layout="zigzag"``):
  with a causal mask and contiguous chunks, rank P-1 has the most keys to
  attend to and rank 0 the fewest; cutting the sequence into 2P chunks and
  giving rank r chunks r and 2P-1-r evens the work (Llama 3's context
  parallelism, the ring-flash-attention project). :func:`ring_step_work` and
  :func:`load_balance` count what the unevenness costs.
- **DeepSpeed-Ulysses** (:func:`ulysses_attention`; Jacobs et al. 2023):
  all-to-alls swap sequence shards for head shards. And the simplest: gather
  all keys and values (:func:`allgather_attention`, with the exact hand-written
  :func:`gather_sequence`).

One concern per module; everything public is importable from here:

- :mod:`.placement`: which tokens each rank holds and which keys a query sees
  (``PLACEMENTS``, :func:`sequence_segments`, :func:`sequence_positions`,
  :func:`shard_sequence`, :func:`attention_mask`, :func:`check_qkv`);
- :mod:`.blockwise`: the arithmetic of one block (:func:`block_attention`,
  :func:`merge_partials`, :func:`block_attention_backward`), the whole forward in
  one process (:func:`blockwise_attention`) and the one-process reference
  (:func:`reference_attention`);
- :mod:`.schedule`: the blocks each rank computes at each ring step
  (:class:`Tile`, :func:`ring_attention_schedule`);
- :mod:`.ring`: the ring itself (:class:`RingPass`, :class:`RingAttention`,
  :func:`ring_attention`, :func:`accumulator_dtype`) and :class:`RingOps`, the
  pieces it calls, to pass others that count the blocks, log the passes or make
  a mistake on purpose;
- :mod:`.ulysses`: Ulysses and the all-gather version, with their bytes
  (:func:`ulysses_bytes`, :func:`ulysses_backward_bytes`);
- :mod:`.cost`: the ring's work, bytes sent and bytes saved per rank
  (:func:`ring_work`, :func:`ring_step_work`, :func:`load_balance`,
  :func:`ring_attention_bytes`, :func:`ring_backward_bytes`, :func:`ring_saved_bytes`) and
  the alpha-beta times of the ring and Ulysses (:func:`ring_comm_time`,
  :func:`ulysses_comm_time`, :func:`ring_ulysses_crossover`);
- :mod:`.gpt`: TinyGPT on a context-parallel group (:class:`ContextParallelGPT`,
  global positions; :func:`context_parallel_loss`, :func:`reduce_gradients`).
"""

from .blockwise import (
    block_attention,
    block_attention_backward,
    blockwise_attention,
    merge_partials,
    reference_attention,
)
from .cost import (
    load_balance,
    ring_attention_bytes,
    ring_backward_bytes,
    ring_comm_time,
    ring_saved_bytes,
    ring_step_work,
    ring_ulysses_crossover,
    ring_work,
    ulysses_comm_time,
)
from .gpt import ContextParallelCore, ContextParallelGPT, context_parallel_loss, reduce_gradients
from .placement import (
    PLACEMENTS,
    attention_mask,
    check_qkv,
    sequence_positions,
    sequence_segments,
    shard_sequence,
)
from .ring import RingAttention, RingOps, RingPass, accumulator_dtype, ring_attention
from .schedule import Tile, ring_attention_schedule
from .ulysses import (
    GatherSequence,
    HeadsToSeq,
    SeqToHeads,
    allgather_attention,
    gather_sequence,
    ulysses_attention,
    ulysses_backward_bytes,
    ulysses_bytes,
)

__all__ = [
    "PLACEMENTS",
    "Tile",
    "ContextParallelCore",
    "ContextParallelGPT",
    "GatherSequence",
    "HeadsToSeq",
    "RingAttention",
    "RingOps",
    "RingPass",
    "SeqToHeads",
    "accumulator_dtype",
    "allgather_attention",
    "attention_mask",
    "block_attention",
    "block_attention_backward",
    "blockwise_attention",
    "check_qkv",
    "context_parallel_loss",
    "gather_sequence",
    "load_balance",
    "merge_partials",
    "reduce_gradients",
    "reference_attention",
    "ring_attention",
    "ring_backward_bytes",
    "ring_attention_bytes",
    "ring_comm_time",
    "ring_saved_bytes",
    "ring_attention_schedule",
    "ring_step_work",
    "ring_ulysses_crossover",
    "ring_work",
    "sequence_positions",
    "sequence_segments",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_backward_bytes",
    "ulysses_bytes",
    "ulysses_comm_time",
]
