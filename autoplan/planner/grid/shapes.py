"""Small pure helpers of the uniform grid: block layers, fitting, divisors, axis groups."""

from __future__ import annotations

import functools
import math

from autoplan.cost.comm import Group
from autoplan.plan import Prediction


def is_block(layer_name: str) -> bool:
    return not layer_name.startswith("<")        # blocks are named; "<pre>", "<post>" not


def fits(pred: Prediction) -> bool:
    return pred.memory.total <= pred.memory_limit_bytes


def divisors(n: int) -> list[int]:
    out = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(out + [n // d for d in out]))


@functools.lru_cache(maxsize=4096)
def axis_group(size: int, per_node: int) -> Group:
    """The group of ``size`` ranks, ``per_node`` of a node's devices on this axis (a pure
    function, cached: the grid asks for the same few groups tens of thousands of times)."""
    return Group(size=size, ranks_per_node=min(size, per_node))
