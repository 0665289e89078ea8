"""Placements as DTensor's objects: the one conversion between :class:`autoplan.placement.
Placement` and ``torch.distributed.tensor``'s ``Replicate`` / ``Shard`` / ``Partial`` /
``_StridedShard``, for the search (asking DTensor's strategy registry,
:mod:`autoplan.planner.search.strategies`) and the engine (applying a plan,
:mod:`engine.placements`, :mod:`engine.tensor_parallel`). The spelling of placements as text
is :mod:`autoplan.placement`'s alone; this module only maps its values to torch's.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.placement import PARTIAL, REPLICATE, SHARD, Placement


def to_dtensor(p: Placement):
    """:class:`Placement` -> DTensor's placement object (a strided shard keeps its inner
    factor: ``_StridedShard(d, split_factor=k)``)."""
    if p.kind == REPLICATE:
        return Replicate()
    if p.kind == PARTIAL:
        return Partial(p.reduce)
    if p.strided:
        return _StridedShard(p.dim, split_factor=p.split)
    return Shard(p.dim)


def from_dtensor(obj) -> Placement | None:
    """DTensor's placement object -> :class:`Placement`; None for a kind outside the
    planned space. Every ``Partial`` (sum or avg) is one: the same collective resolves it."""
    if isinstance(obj, _StridedShard):
        return Placement(SHARD, obj.dim, obj.split_factor)
    if isinstance(obj, Shard):
        return Placement(SHARD, obj.dim)
    if isinstance(obj, Replicate):
        return Placement(REPLICATE)
    if isinstance(obj, Partial):
        return Placement(PARTIAL)
    return None
