"""Expert parallelism inside data parallelism: EP x DP groups (notebook 15).

With fewer experts' ranks than ranks (EP < world size), the ranks form a 2-D
mesh ``(dp, ep)``: rank ``d * EP + e`` sits in row d, column e. Each row is
an expert-parallel group that holds all E experts, E / EP per rank
(:func:`~ddp_course.expert_parallel.experts_of_rank` with the rank's column
``e``); the rows are data-parallel replicas of one another, each on its own
tokens. The columns are the *expert-data-parallel* groups: the ranks that
hold the same experts (Megatron-LM's expert data-parallel group,
``_EXPERT_DATA_PARALLEL_GROUP`` in ``megatron/core/parallel_state.py``,
formerly ``_DATA_MODULO_EXPERT_PARALLEL_GROUP``; DeepSpeed-MoE's
"expert + data" parallelism, Rajbhandari et al. 2022). Consecutive ranks share an
expert-parallel group, so its all-to-alls stay on one node when EP fits one.

Gradients, with each rank's loss the mean over its own tokens and the
training loss the mean of the ranks' losses (``world_size`` ranks, equal
token counts):

- a **dense** (non-expert) weight, the router, is replicated on every rank:
  its gradient is averaged over all ranks (an all-reduce of the sum,
  divided by ``world_size``), as plain data parallelism does;
- an **expert** weight is held by the DP ranks of its column. After
  backward it already holds the sum over its EP group's ranks (the reverse
  all-to-all brought every row's gradient home); the sum over the column
  (the orthogonal, DP group) completes the sum over all ranks, divided by
  ``world_size`` too. Reducing over the EP group instead, or not at all,
  trains each replica's experts on a different share of the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_DIMS", "average_gradients", "expert_data_parallel_mesh"]

MESH_DIMS = ("dp", "ep")


def expert_data_parallel_mesh(device_type: str, world_size: int, ep_size: int) -> DeviceMesh:
    """The 2-D mesh ``(world_size / ep_size, ep_size)``, named :data:`MESH_DIMS`.

    ``mesh.get_group("ep")`` is this rank's expert-parallel group (a row of
    consecutive ranks), ``mesh.get_group("dp")`` its expert-data-parallel
    group (a column), ``mesh.get_local_rank("ep")`` its place in the row.
    Every rank must call it (it creates the groups).

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (``ctx.device.type``).
        world_size: ranks in the job.
        ep_size: ranks per expert-parallel group, dividing ``world_size``.

    Raises:
        ValueError: ``ep_size`` does not divide ``world_size``.
    """
    if not 1 <= ep_size <= world_size or world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide world_size={world_size}")
    return init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=MESH_DIMS)


def average_gradients(
    experts: Iterable[torch.nn.Parameter],
    dense: Iterable[torch.nn.Parameter],
    expert_group: dist.ProcessGroup | None,
    world_size: int,
) -> None:
    """Average the gradients of an EP x DP job in place (module docstring).

    Args:
        experts: this rank's expert parameters (their ``.grad`` summed over
            the EP group by the reverse all-to-all).
        dense: the replicated parameters (router, embeddings, ...).
        expert_group: the expert-data-parallel group, ``mesh.get_group("dp")``.
        world_size: ranks in the job; every gradient is divided by it.

    Raises:
        AttributeError: a parameter without a gradient (``None.div_``).
    """
    for q in experts:
        dist.all_reduce(q.grad, group=expert_group)
        q.grad.div_(world_size)
    for q in dense:
        dist.all_reduce(q.grad)
        q.grad.div_(world_size)
