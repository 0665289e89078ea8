"""Logical device meshes for the search: a stage's submesh seen as 2 named axes.

A stage runs on a *submesh*: ``(1, 2^k)`` devices inside one node, or ``(n, M)`` — n whole
nodes of M devices (Alpa, Zheng et al. 2022, sec. 5.2). Its devices are viewed as a 2-D
*logical mesh* ``(a0, a1)``, row-major over the submesh's ranks, so axis 1 is the
fastest-varying one (consecutive ranks: NVLink inside a node when ``a1`` divides M) and
axis 0 strides across nodes. The intra-op pass chooses what each axis does (data
parallelism, tensor parallelism, ZeRO sharding, sequence sharding); a 1-D mesh is
``(1, n)``. The communication group along each axis is the cost model's
:class:`~autoplan.cost.comm.Group` of that axis (:meth:`Group.for_mesh_axis`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autoplan.cost.comm import Group

AXIS_NAMES = ("a0", "a1")


@dataclass(frozen=True)
class LogicalMesh:
    """``shape`` = (a0, a1) over ``shape[0] * shape[1]`` consecutive ranks that start at a
    node boundary (or inside one node, for submeshes smaller than a node)."""

    shape: tuple[int, int]
    devices_per_node: int

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or min(self.shape) < 1:
            raise ValueError(f"a logical mesh has 2 positive axes, got {self.shape}")

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.devices_per_node)

    def group(self, axes: tuple[int, ...]) -> Group:
        """The group spanned by ``axes`` (() -> a group of one)."""
        return _group(self.shape, self.devices_per_node, tuple(axes))

    def label(self) -> str:
        return f"{self.shape[0]}x{self.shape[1]}"


@functools.lru_cache(maxsize=4096)
def _group(shape: tuple[int, int], devices_per_node: int, axes: tuple[int, ...]) -> Group:
    """A pure function of its arguments (cached: the search asks for the same few groups
    many times)."""
    if not axes:
        return Group(size=1, ranks_per_node=1)
    if len(axes) == 1:
        return Group.for_mesh_axis(shape, axes[0], devices_per_node)
    n = shape[0] * shape[1]
    return Group(size=n, ranks_per_node=min(n, devices_per_node))


def submesh_shapes(devices: int, devices_per_node: int) -> list[LogicalMesh]:
    """Logical meshes of a submesh of ``devices`` devices: ``(devices / b, b)`` for every b
    dividing both the node size and ``devices`` (axis 1 inside a node). b = 1 is the 1-D
    mesh over all the devices, on which either parallelism may span nodes."""
    g = math.gcd(devices, devices_per_node)
    return [LogicalMesh((devices // b, b), devices_per_node)
            for b in range(1, g + 1) if g % b == 0]
