"""How a tensor of ``numel`` elements (or a layer of ``numel`` features) is cut into
``world_size`` contiguous shards, rank 0 first: the one partition rule of the course,
in the three styles its mechanisms need.

- ``"split"``: the first ``numel % world_size`` shards get one element more, as
  ``torch.tensor_split`` cuts; the ring all-reduce's chunks (lesson 04).
- ``"padded"``: every shard has ``ceil(numel / world_size)`` slots, so collectives see
  equal pieces of a buffer padded to ``world_size`` shards; the padding belongs to no
  one, so the last shards are shorter or empty. ZeRO's and FSDP's flat parameter
  shards (lesson 09; Rajbhandari et al., SC 2020; PyTorch's ``FlatParameter``).
- ``"even"``: ``numel`` must be a multiple of ``world_size``; every shard is
  ``numel / world_size`` long. Tensor parallelism's column and row shards (lesson 08;
  Megatron-LM, Shoeybi et al. 2019, requires the same).
"""

from __future__ import annotations

import math

__all__ = ["STYLES", "check_rank", "partition"]

STYLES = ("split", "padded", "even")


def partition(
    numel: int, world_size: int, style: str = "split", what: str = "numel"
) -> list[tuple[int, int]]:
    """Where each rank's shard starts and stops.

    Concatenating the shards in rank order gives the whole: shard r is
    ``[start_r, stop_r)`` with ``start_0 = 0``, ``stop_r = start_{r+1}`` and
    ``stop_{N-1} = numel``.

    Args:
        numel: elements (or features) to cut, >= 0.
        world_size: number of shards N, >= 1.
        style: ``"split"``, ``"padded"`` or ``"even"`` (see the module docstring).
        what: the name of ``numel`` in an error message (e.g. ``"hidden"``).

    Returns:
        ``[(start, stop), ...]`` element offsets, one pair per rank.

    Raises:
        ValueError: ``numel < 0``, ``world_size < 1``, an unknown style, or, for
            ``"even"``, a ``numel`` that is not a multiple of ``world_size`` (the
            message names a size that is).
    """
    if numel < 0:
        raise ValueError(f"{what} must be >= 0, not {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, not {style!r}")
    if style == "even" and numel % world_size:
        raise ValueError(
            f"{what}={numel} is not divisible by the world size {world_size}: every rank "
            f"must own an equal shard; pick {what} a multiple of {world_size} (e.g. "
            f"{-(-numel // world_size) * world_size}) or another number of ranks"
        )
    if style == "padded":
        slots = math.ceil(numel / world_size)
        return [(min(r * slots, numel), min((r + 1) * slots, numel)) for r in range(world_size)]
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def check_rank(rank: int, world_size: int, name: str = "rank") -> None:
    """Raise ValueError unless ``world_size >= 1`` and ``0 <= rank < world_size``
    (a negative rank would silently index a shard from the end)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{name} {rank} is not in [0, {world_size})")
