"""PyTorch's own all-gather and reduce-scatter into one tensor, under one name across releases.

The hand-written collectives of ``ddp_course.collectives`` are built from
``isend``/``irecv`` only; the sharding mechanisms (ZeRO in ``sharding``, FSDP in
``fsdp``, sequence parallelism) and lesson 10's benchmark call PyTorch's fused
collectives instead, through these two functions. torch 2.13 renamed them
(``all_gather_into_tensor`` -> ``all_gather_single``, ``reduce_scatter_tensor`` ->
``reduce_scatter_single``; the arguments are the same), so the name is looked up at
each call: a log that wraps ``torch.distributed``'s functions while it records
(``tools.collective_log``) sees the call either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]


def all_gather_single(out: torch.Tensor, piece: torch.Tensor, group=None) -> None:
    """PyTorch's all-gather into one tensor: every rank's ``piece`` (the same shape on
    each), rank 0's first, concatenated along dim 0 into ``out`` (``[N * k, ...]`` for a
    ``[k, ...]`` piece).

    ``dist.all_gather_single`` since torch 2.13, ``dist.all_gather_into_tensor`` (the
    same arguments) before; looked up at each call, so a log that wraps
    ``torch.distributed``'s functions while it records sees it.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, piece, group=group)


def reduce_scatter_single(out: torch.Tensor, full: torch.Tensor, group=None) -> None:
    """PyTorch's reduce-scatter from one tensor: ``full`` (``[N * k, ...]``, the same on
    every rank in shape) summed over ranks, rank r receiving rows ``[r k, (r + 1) k)`` of
    the sum in ``out`` (``[k, ...]``). Summed, not averaged: ``ReduceOp.AVG`` is not on
    every backend, so callers divide by N.

    ``dist.reduce_scatter_single`` since torch 2.13, ``dist.reduce_scatter_tensor``
    before (see :func:`all_gather_single`).
    """
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full, op=dist.ReduceOp.SUM, group=group)
