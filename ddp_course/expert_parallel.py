"""Mixture of experts, on one process and with its experts spread over ranks (notebook 15).

A mixture-of-experts (MoE) feed-forward layer replaces a Transformer block's
one MLP by E MLPs ("experts") and a router that sends each token to k of
them (Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", 2017, section 2):

- the router is a linear map ``d_model -> E`` (no bias); a softmax over its
  E logits gives each token's probabilities, and the k largest are its gates
  and chosen experts (:func:`route`). With ``k > 1`` the k gates are
  renormalised to sum to 1 (GShard, Lepikhin et al. 2020, section 2.2 and
  Algorithm 1, top-2; Shazeer et al. 2017 eq. 3-5 reach the same by a softmax
  over the k kept logits). With ``k = 1`` the gate is the raw probability,
  as in the Switch Transformer (Fedus et al. 2021, section 2.1, eq. 1-2):
  renormalising one gate would make it 1 and leave the router without a
  gradient from the output.
- each expert holds a fixed number of token slots, its *capacity*
  ``ceil(capacity_factor * tokens * k / E)`` (Switch Transformer, section 2.2,
  eq. 3, with ``k`` as GShard counts top-2 slots). Assignments beyond it are
  dropped: their expert output is zero and the block's residual connection
  carries the token on unchanged. Priority: every token's first choice
  before any second choice, then token order (GShard, Algorithm 1).
- the load-balancing auxiliary loss ``E * sum_i f_i * P_i``, with ``f_i`` the
  fraction of assignments the router gave expert i and ``P_i`` the mean
  router probability of expert i (Switch Transformer, section 2.2, eq. 4-6).
  It is 1 when both are uniform and grows as the router favours a few
  experts; only ``P_i`` carries a gradient.

Capacity is counted per *group* of tokens, as in GShard (section 2.2: the
tokens of a batch are split into G groups, each routed with its own
capacity). :class:`MoE` takes ``groups`` for that; the expert-parallel
version (:class:`ExpertParallelMoE`) makes each rank's tokens one group, so
it equals the one-process :class:`MoE` with ``groups = world_size`` on the
ranks' batches concatenated in rank order.

Expert parallelism (GShard, section 3; Switch Transformer, section 5.4)
places E / world_size experts on each rank. Each rank routes its own tokens,
then one ``all_to_all_single`` with uneven split sizes sends every kept
assignment to the rank that holds its expert (the split sizes come from the
routing and are exchanged first with an all-to-all of counts), the local
experts run, and a second ``all_to_all_single`` with the splits swapped
brings the results home. In backward each exchange's gradient goes back by
the reverse all-to-all (:class:`AllToAll`). PyTorch ships the same
differentiable exchange as
``torch.distributed._functional_collectives.all_to_all_single_autograd``
(a private module: its name may change) and the operation as
``torch.distributed.all_to_all_single``
(https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single).

:class:`SharedExpertMoE` adds an expert that every token goes through
(DeepSeekMoE). GShard's capacity-padded exchange, against this one's
dropless use (``capacity_factor=float("inf")``), is in
``expert_parallel_dropless``; expert parallelism inside data parallelism
(EP x DP groups) in ``expert_data_parallel``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .models import FeedForward
from .runtime import require_group

__all__ = [
    "AllToAll",
    "ExpertParallelMoE",
    "MoE",
    "Routing",
    "SharedExpertMoE",
    "all_to_all",
    "capacity",
    "experts_of_rank",
    "route",
]


def capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Token slots per expert: ``ceil(capacity_factor * tokens * k / num_experts)``.

    Switch Transformer (Fedus et al. 2021), section 2.2, eq. 3, with ``k``
    assignments per token (GShard, Lepikhin et al. 2020, top-2).

    Args:
        tokens: tokens routed together (one group), >= 0.
        num_experts: E, >= 1.
        k: experts per token, 1 <= k <= E.
        capacity_factor: > 0; 1.0 leaves no slack for imbalance; ``float("inf")``
            drops nothing (dropless routing).

    Returns:
        Slots per expert (int). With an infinite factor: ``tokens``, the most an
        expert can be given, since a token's k choices are k different experts.

    Raises:
        ValueError: a size out of range.
    """
    if num_experts < 1 or not 1 <= k <= num_experts:
        raise ValueError(f"need 1 <= k <= num_experts, got k={k}, num_experts={num_experts}")
    if tokens < 0 or not capacity_factor > 0:  # "not >" also refuses NaN
        raise ValueError(
            f"need tokens >= 0 and capacity_factor > 0, got {tokens}, {capacity_factor}"
        )
    if math.isinf(capacity_factor):
        return tokens
    return math.ceil(capacity_factor * tokens * k / num_experts)


@dataclass
class Routing:
    """Where one group's tokens go, from :func:`route`.

    Shapes for n tokens, E experts, k choices each:

    - ``probs``: float ``[n, E]``, the router's softmax (differentiable).
    - ``gates``: float ``[n, k]``, the weights of the chosen experts
      (differentiable; renormalised when ``k > 1``).
    - ``experts``: int64 ``[n, k]``, the chosen experts, best first.
    - ``keep``: bool ``[n, k]``, False where the expert was full (dropped).
    - ``slot``: int64 ``[n, k]``, the assignment's place among its expert's
      assignments in GShard's order (``keep`` is ``slot < capacity``).
    - ``capacity``: slots per expert (int).
    - ``routed``: int64 ``[E]``, assignments the router made to each expert.
    - ``kept``: int64 ``[E]``, those within capacity (``<= capacity``).
    - ``aux_loss``: float scalar, Switch Transformer eq. 4, ``E * sum f_i P_i``.
    """

    probs: torch.Tensor
    gates: torch.Tensor
    experts: torch.Tensor
    keep: torch.Tensor
    slot: torch.Tensor
    capacity: int
    routed: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor

    @property
    def dropped(self) -> int:
        """Assignments dropped because their expert was full."""
        return int((self.routed - self.kept).sum())


def route(
    logits: torch.Tensor, k: int, capacity_factor: float, normalize: bool | None = None
) -> Routing:
    """Top-k routing of one group with capacity and the load-balancing loss.

    Args:
        logits: float ``[n, E]``, the router's output for n tokens.
        k: experts per token.
        capacity_factor: see :func:`capacity`.
        normalize: renormalise the k gates to sum to 1; default ``k > 1``
            (GShard top-2 does, Switch top-1 does not; module docstring).

    Returns:
        :class:`Routing`. Capacity priority: all first choices (in token
        order) before any second choice (GShard, Algorithm 1). The loss's
        ``f_i`` counts the router's assignments before capacity, as the
        Switch Transformer's does (its argmax mask).

    Raises:
        ValueError: ``logits`` not 2-D, or k out of range.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, num_experts], got {list(logits.shape)}")
    n, num_experts = logits.shape
    cap = capacity(n, num_experts, k, capacity_factor)
    probs = torch.softmax(logits, dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    if k > 1 if normalize is None else normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    # Choice-major order (column j of every token before column j+1): the slot an
    # assignment gets in its expert is the number of earlier assignments to that expert.
    order = experts.t().reshape(-1)
    one_hot = nn.functional.one_hot(order, num_experts)
    slot = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
    slot = slot.reshape(k, n).t()
    keep = slot < cap
    routed = one_hot.sum(0)
    kept = nn.functional.one_hot(experts[keep], num_experts).sum(0)
    f = routed.to(probs.dtype) / max(n * k, 1)
    aux = num_experts * (f * probs.mean(0)).sum()
    return Routing(probs, gates, experts, keep, slot, cap, routed, kept, aux)


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer on one process.

    Input float ``[tokens, d_model]`` or ``[B, T, d_model]`` (flattened to
    ``B*T`` tokens, row-major); output of the same shape and dtype:
    ``y_t = sum_j keep[t, j] * gate[t, j] * expert_{e[t, j]}(x_t)``, zero for a
    token whose every assignment was dropped (the residual carries it).

    Args:
        d_model: features in and out.
        hidden: hidden features of each expert (a :class:`FeedForward`).
        num_experts: E.
        k: experts per token (1: Switch Transformer, 2: GShard).
        capacity_factor: see :func:`capacity`; ``float("inf")`` drops nothing.
        normalize: renormalise the k gates (default ``k > 1``).

    Attributes:
        router: ``nn.Linear(d_model, num_experts, bias=False)``.
        experts: ``nn.ModuleList`` of E :class:`FeedForward`.
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.25,
        normalize: bool | None = None,
    ):
        super().__init__()
        capacity(0, num_experts, k, capacity_factor)  # validates the sizes now
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.capacity_factor, self.normalize = capacity_factor, normalize
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(d_model, hidden) for _ in range(num_experts))

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``[tokens, d_model]``; ValueError if its last size is not d_model."""
        if x.dim() < 2 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"expected [tokens, {self.d_model}] or [B, T, {self.d_model}], got {list(x.shape)}"
            )
        return x.reshape(-1, self.d_model)

    def route(self, tokens: torch.Tensor) -> Routing:
        """:func:`route` of ``[n, d_model]`` tokens with this layer's router and settings."""
        return route(self.router(tokens), self.k, self.capacity_factor, self.normalize)

    def forward(self, x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, list[Routing]]:
        """Route, run the experts, combine.

        Args:
            x: float ``[tokens, d_model]`` or ``[B, T, d_model]``.
            groups: split the tokens into this many equal groups, each routed
                with its own capacity (GShard's groups; an expert-parallel
                job with ``world_size`` ranks equals ``groups=world_size``).

        Returns:
            ``(y, routings)``: ``y`` like ``x``; one :class:`Routing` per group.

        Raises:
            ValueError: wrong last size, or ``groups`` not dividing the tokens.
        """
        tokens = self.flat(x)
        if groups < 1 or tokens.shape[0] % groups:
            raise ValueError(
                f"groups={groups} must divide the {tokens.shape[0]} tokens "
                "(equal groups, e.g. one per rank's batch)"
            )
        routings = [self.route(g) for g in tokens.chunk(groups)] if tokens.shape[0] else []
        if not routings:
            return x.clone(), routings
        gates = torch.cat([r.gates for r in routings])
        experts = torch.cat([r.experts for r in routings])
        keep = torch.cat([r.keep for r in routings])
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            t, j = torch.nonzero((experts == e) & keep, as_tuple=True)
            out = out.index_add(0, t, gates[t, j, None] * expert(tokens[t]))
        return out.reshape(x.shape), routings


def experts_of_rank(num_experts: int, world_size: int, rank: int) -> range:
    """The experts rank ``rank`` holds: a contiguous block of ``E / world_size``.

    Raises:
        ValueError: ``world_size`` does not divide ``num_experts``.
    """
    if world_size < 1 or num_experts % world_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by world_size={world_size}: "
            "choose a number of experts that is a multiple of the number of ranks "
            f"(e.g. {world_size * max(1, -(-num_experts // max(world_size, 1)))})"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} does not fit world_size={world_size}")
    per = num_experts // world_size
    return range(rank * per, (rank + 1) * per)


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits, differentiable.

    Forward: rank r sends rows ``input_splits[s]`` of ``x`` (in order) to each
    rank s and receives ``output_splits[s]`` rows from each rank s. Backward:
    the same exchange with the two split lists swapped, since the gradient
    of a row goes back to the rank the row came from.

    Shapes and dtypes: ``x`` ``[sum(input_splits), *]``, output
    ``[sum(output_splits), *]``, same dtype. Call it through :func:`all_to_all`.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), list(output_splits), list(input_splits), group=group
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            back, grad.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return back, None, None, None


def all_to_all(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows (see :class:`AllToAll`).

    Args:
        x: ``[sum(input_splits), *]``, rows to send, grouped by destination rank.
        output_splits: rows to receive from each rank (length world size).
        input_splits: rows to send to each rank (length world size).
        group: the process group (default: the whole job).

    Returns:
        ``[sum(output_splits), *]``, the received rows grouped by source rank.

    Raises:
        RuntimeError: no process group. ValueError: ``x`` has not
        ``sum(input_splits)`` rows.
    """
    require_group(needed_for="expert parallelism")
    if x.shape[0] != sum(input_splits):
        raise ValueError(f"x has {x.shape[0]} rows but input_splits sum to {sum(input_splits)}")
    return AllToAll.apply(x, output_splits, input_splits, group)


class ExpertParallelMoE(nn.Module):
    """:class:`MoE` with its experts spread over the ranks of a process group.

    Built from a whole :class:`MoE` (the same on every rank): the router is
    copied whole (replicated: sum its gradient over the ranks, e.g. with
    DDP or ``dist.all_reduce``), and rank r keeps copies of the experts
    :func:`experts_of_rank` gives it, whose gradients are complete after
    backward (the reverse all-to-all brings every rank's contribution).

    Forward on this rank's ``[n, d_model]`` tokens (``[B, T, d_model]``
    flattened), any ``n`` per rank:

    1. route locally (capacity from this rank's n: one GShard group);
    2. sort the kept assignments by expert, so rows for rank s are contiguous;
    3. all-to-all of counts ``[world_size, E / world_size]`` int64, so every
       rank knows how many rows it receives for each of its experts;
    4. all-to-all of the rows (``input_splits``: rows per destination rank,
       ``output_splits``: rows per source rank, from step 3);
    5. run each local expert on its rows;
    6. all-to-all back with the splits swapped; weight by the gates and add up.

    Communication per forward: E int64 counts (8 bytes each), then each way
    ``rows to other ranks x d_model x element size`` bytes, a row per kept
    assignment (a token sent to two experts on one rank travels twice);
    backward sends the same amounts in reverse. With a per-rank loss that is a
    mean over the rank's tokens, the experts receive the *sum* of the ranks'
    gradients: divide each rank's loss by the world size to train on the
    global mean (what ``scripts/15_moe.py`` does).

    Args:
        moe: the whole layer.
        rank, world_size: this rank and the group's size (``ctx.rank``,
            ``ctx.world_size``).
        group: the expert-parallel process group (default: the whole job).
        exchange: the differentiable all-to-all, ``f(x, output_splits,
            input_splits, group)``; default :func:`all_to_all`.

    Raises:
        ValueError: ``world_size`` does not divide the number of experts.
    """

    def __init__(
        self,
        moe: MoE,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        exchange: Callable | None = None,
    ):
        super().__init__()
        self.local = experts_of_rank(moe.num_experts, world_size, rank)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.d_model, self.num_experts, self.k = moe.d_model, moe.num_experts, moe.k
        self.capacity_factor, self.normalize = moe.capacity_factor, moe.normalize
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in self.local)
        self.exchange = all_to_all if exchange is None else exchange

    def route_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """This rank's tokens as ``[n, d_model]``, and their :func:`route` (one group).

        Raises:
            ValueError: wrong last size. RuntimeError: no process group.
        """
        require_group(needed_for="expert parallelism")
        if x.dim() < 2 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"expected [tokens, {self.d_model}] or [B, T, {self.d_model}], got {list(x.shape)}"
            )
        tokens = x.reshape(-1, self.d_model)
        return tokens, route(self.router(tokens), self.k, self.capacity_factor, self.normalize)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing, dict]:
        """Route, exchange, run the local experts, exchange back, combine.

        Args:
            x: float ``[n, d_model]`` or ``[B, T, d_model]``, this rank's tokens.

        Returns:
            ``(y, routing, splits)``: ``y`` like ``x``; this rank's
            :class:`Routing`; ``splits`` with ``"send"`` and ``"receive"``,
            rows (assignments) per rank, lists of length world size.

        Raises:
            ValueError: wrong last size. RuntimeError: no process group.
        """
        tokens, routing = self.route_tokens(x)
        t, j = torch.nonzero(routing.keep, as_tuple=True)
        expert = routing.experts[t, j]
        order = torch.argsort(expert, stable=True)  # rows grouped by expert, so by rank
        t, j, expert = t[order], j[order], expert[order]
        per = len(self.local)
        send_counts = torch.bincount(expert, minlength=self.num_experts)  # [W * per]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send = send_counts.view(self.world_size, per).sum(1).tolist()
        recv_by = recv_counts.view(self.world_size, per)  # [source rank, local expert]
        recv = recv_by.sum(1).tolist()
        received = self.exchange(tokens[t], recv, send, self.group)
        # Received rows: source 0's rows for local experts 0..per-1, then source 1's ...
        local_expert = torch.repeat_interleave(
            torch.arange(per, device=x.device).repeat(self.world_size), recv_by.reshape(-1)
        )
        results = torch.zeros_like(received)
        for i, ex in enumerate(self.experts):
            rows = torch.nonzero(local_expert == i, as_tuple=True)[0]
            results = results.index_copy(0, rows, ex(received[rows]))
        back = self.exchange(results, send, recv, self.group)
        out = torch.zeros_like(tokens).index_add(0, t, routing.gates[t, j, None] * back)
        return out.reshape(x.shape), routing, {"send": send, "receive": recv}


class SharedExpertMoE(nn.Module):
    """A mixture of experts plus one *shared* expert that every token goes through.

    ``y = shared(x) + moe(x)``: the routed experts learn what is particular to
    their tokens, the shared one what all tokens need (DeepSeekMoE, Dai et al.
    2024, "shared expert isolation"; DeepSeek-V3 and Qwen-MoE use it). With
    expert parallelism the shared expert is dense: every rank holds it whole,
    like the router, and its gradient is summed over the ranks. A token whose
    every choice was dropped still gets ``shared(x)``.

    Args:
        moe: :class:`MoE` or :class:`ExpertParallelMoE`; its extra outputs
            (routings, splits) pass through unchanged.
        shared: the shared expert, float ``[*, d_model] -> [*, d_model]``
            (e.g. a :class:`FeedForward`).

    Returns (forward): ``moe``'s tuple with ``shared(x)`` added to its first item.
    """

    def __init__(self, moe: nn.Module, shared: nn.Module):
        super().__init__()
        self.moe, self.shared = moe, shared

    def forward(self, x: torch.Tensor, *args, **kwargs) -> tuple:
        y, *rest = self.moe(x, *args, **kwargs)
        return (y + self.shared(x), *rest)
