"""Dropless against capacity-padded expert parallelism: what crosses the all-to-all (notebook 15).

Two ways to send tokens to the ranks that hold their experts:

- **Capacity-padded** (GShard, Lepikhin et al. 2020, Algorithm 1 and section
  3.1; Switch Transformer, Fedus et al. 2021, section 2.2): every expert has
  a buffer of ``capacity`` rows on every rank, filled with the assignments
  it was given in GShard's order and zeros after them; assignments beyond it
  are dropped. The buffers ``[E, capacity, d_model]`` go out in one
  all-to-all with *equal* splits, ``E / N * capacity`` rows to each of the N
  ranks. The sizes follow from the shapes alone: no count is exchanged and
  the host never waits for the device. The price: every empty slot travels
  (and is computed), and a full expert drops tokens.
  :class:`PaddedExpertParallelMoE`.
- **Dropless** (MegaBlocks, Gale et al. 2022, "MegaBlocks: Efficient Sparse
  Training with Mixture-of-Experts"; the default of Megatron-LM and
  torchtitan): no capacity (``capacity_factor=float("inf")``), and the
  all-to-all sends exactly the routed rows, with *uneven* splits.
  :class:`~ddp_course.expert_parallel.ExpertParallelMoE` is that exchange
  already: given an infinite capacity factor it drops nothing and sends
  :func:`routed_rows_to_others` rows. The split sizes come from the routing,
  a tensor on the device, and ``all_to_all_single`` takes them as Python
  ints: they must be copied to the host (``.tolist()`` in
  ``ExpertParallelMoE.forward``) before the exchange can start. On a GPU that
  copy waits for every kernel queued before it, a *host sync* on each MoE
  layer (MegaBlocks' grouped matrix products take the uneven expert batches
  without padding; the sync before the exchange remains).

Both equal the one-process :class:`~ddp_course.expert_parallel.MoE` with
``groups = world_size`` and the same capacity factor, forward and backward.
"""

from __future__ import annotations

import torch

from .expert_parallel import ExpertParallelMoE, Routing

__all__ = ["PaddedExpertParallelMoE", "padded_rows_to_others", "routed_rows_to_others"]


def padded_rows_to_others(capacity: int, num_experts: int, world_size: int) -> int:
    """Rows a rank sends to other ranks per padded exchange: ``(N-1) * E/N * capacity``.

    Each rank sends every other rank the buffers of its ``E/N`` experts,
    ``capacity`` rows each, whatever the routing (GShard's dispatch tensor).
    Multiply by ``d_model * element size`` for bytes.
    """
    return (world_size - 1) * num_experts // world_size * capacity


def routed_rows_to_others(routing: Routing, rank: int, world_size: int) -> int:
    """Rows a rank sends to other ranks per dropless (uneven) exchange.

    One row per kept assignment whose expert lives on another rank (experts
    in contiguous blocks of ``E/N``, :func:`~ddp_course.expert_parallel.experts_of_rank`);
    with an infinite capacity factor, every routed assignment. Multiply by
    ``d_model * element size`` for bytes.
    """
    per = routing.probs.shape[-1] // world_size
    return int((routing.experts[routing.keep] // per != rank).sum())


class PaddedExpertParallelMoE(ExpertParallelMoE):
    """:class:`~ddp_course.expert_parallel.ExpertParallelMoE` with GShard's padded dispatch.

    Built and called like its parent (the same ``moe``, ``rank``,
    ``world_size``, ``group``, ``exchange``). Forward on this rank's
    ``[n, d_model]`` tokens (``[B, T, d_model]`` flattened), with ``n`` the
    same on every rank (the buffers must have one size):

    1. route locally (capacity from n; ``float("inf")`` gives ``n`` slots);
    2. copy each kept assignment to row ``slot`` of its expert's buffer,
       ``[E * capacity, d_model]``, zeros elsewhere;
    3. all-to-all with equal splits, ``E/N * capacity`` rows per rank;
    4. run each local expert on its ``N * capacity`` rows, padding included;
    5. all-to-all back, and add up ``gate * row`` for the kept assignments.

    Returns ``(y, routing, splits)`` like its parent; ``splits["send"]`` and
    ``splits["receive"]`` are the equal splits.

    Raises:
        ValueError: wrong last size. RuntimeError: no process group.
    """

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing, dict]:
        tokens, routing = self.route_tokens(x)
        cap, per = routing.capacity, len(self.local)
        t, j = torch.nonzero(routing.keep, as_tuple=True)
        row = routing.experts[t, j] * cap + routing.slot[t, j]  # expert-major buffer rows
        buffers = tokens.new_zeros(self.num_experts * cap, self.d_model)
        buffers = buffers.index_copy(0, row, tokens[t])
        # Equal splits, from shapes only: Python ints that never touch the device.
        splits = [per * cap] * self.world_size
        received = self.exchange(buffers, splits, splits, self.group)
        received = received.view(self.world_size, per, cap, self.d_model)  # [source, expert]
        results = torch.stack([ex(received[:, i]) for i, ex in enumerate(self.experts)], 1)
        back = self.exchange(results.reshape(-1, self.d_model), splits, splits, self.group)
        out = torch.zeros_like(tokens).index_add(0, t, routing.gates[t, j, None] * back[row])
        return out.reshape(x.shape), routing, {"send": splits, "receive": splits}
