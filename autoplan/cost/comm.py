"""Communication cost: an alpha-beta model of NCCL/gloo collectives on a :class:`Cluster`.

Model (times in seconds, ``S`` = bytes of the full, unsharded tensor, as nccl-tests counts)::

    t(collective, S, group) = alpha(collective, group) + S * f(collective, n) / busbw(group)

    f = 2(n-1)/n  all_reduce                  (ring: reduce-scatter then all-gather)
        (n-1)/n   all_gather, reduce_scatter, all_to_all
        1         send_recv                   (S = bytes sent)

This is the definition of nccl-tests' *bus bandwidth* (busbw = algbw * f), so the measured
busbw figures in published.md plug in directly (e.g. 8x A100 NVSwitch ~230 GB/s: an
all-reduce of 1 GB inside a DGX A100 takes 2 * 7/8 * 1e9 / 230e9 = 7.6 ms).

Group bandwidth. A :class:`Group` of ``size`` ranks with ``ranks_per_node`` (k) ranks in each
node spans ``nodes = ceil(size / k)`` nodes.

* Inside one node, busbw = the intra-node link's bandwidth.
* Across nodes, the node's NICs (``nics`` x per-NIC busbw = B_node) are shared by the
  groups crossing the node boundary at the same time. By default every device of the node
  is in some group of the same shape and they all communicate together (DP groups of a
  TP x DP grid, a ZeRO all-gather, ...), so ``concurrent = devices_per_node / k`` groups
  share B_node and each gets k * B_node / devices_per_node. A rank drives at most its own
  share of NICs (max(1, nics / devices_per_node) of them), and a group with k > 1 is also
  limited by the intra-node stage of the hierarchical ring::

      busbw = min(B_node / concurrent, k * nic_bw * max(1, nics / devices_per_node),
                  intra_busbw if k > 1)

  DGX A100 (8 x HDR at 24 GB/s): TP=8 inside each node and DP across nodes gives DP groups
  with k = 1, each on one NIC: 24 GB/s. A DP group over whole nodes (k = 8) gets
  8 x 24 = 192 GB/s, the multi-node nccl-tests figure in published.md.
* ``send_recv`` across nodes (pipeline stages on different nodes) is the same formula with
  k = 1: one NIC's bandwidth when every device sends at once.

Latency. ``alpha`` counts algorithm steps times the per-step latency of each link level:
a ring over the k ranks inside each node ((k-1) steps per phase at the intra-node latency)
and a tree across nodes (ceil(log2(nodes)) steps per phase at the inter-node latency);
all_reduce has two phases, the others one; send_recv is one step at its level. NCCL's own
tuning model (src/graph/tuning.cc) has this shape: a base latency plus a per-step hardware
latency of ~0.6-3.4 us on NVLink and ~5-14 us on the network, depending on protocol.

Measured profiles. ``CommModel(cluster, fitted=...)`` takes a table
``{(collective, level): (alpha_s, beta_s_per_byte)}`` with level ``"intra"`` or ``"inter"``
(what the collective profiler of issue #4 fits); an entry replaces the defaults for that
collective and level: t = alpha + S * f(collective, n) * beta.
``CommModel(cluster, measured=fn)`` goes further: ``fn(collective, nbytes, group, level)``
returns the seconds a measured profile gives for that very group size and message size
(e.g. the piecewise fit per group size of a link profile, :mod:`autoplan.cost.profiled`),
or None to fall back to ``fitted`` and then to the defaults above.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from autoplan.cluster import Cluster

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
LEVELS = ("intra", "inter")

#: ``fn(collective, nbytes, group, level)`` -> seconds, or None (see the module docstring).
MeasuredCommFn = Callable[[str, float, "Group", str], "float | None"]


def bus_factor(collective: str, n: int) -> float:
    """Bytes each rank moves per byte of the full tensor, in busbw terms (see module doc)."""
    _check_collective(collective)
    if collective == "send_recv":
        return 1.0
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


@dataclass(frozen=True)
class Group:
    """A process group's shape: ``size`` ranks, ``ranks_per_node`` of them in each node.

    ``concurrent``: how many groups of this shape share each node's NICs at the same time;
    None means ``devices_per_node // ranks_per_node`` (every device busy, the usual case).
    """

    size: int
    ranks_per_node: int
    concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("size", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Group.{name} must be a positive integer, got {value!r}")
        if self.ranks_per_node > self.size:
            raise ValueError(f"Group.ranks_per_node ({self.ranks_per_node}) > size ({self.size})")
        if self.concurrent is not None and (isinstance(self.concurrent, bool)
                                            or not isinstance(self.concurrent, int)
                                            or self.concurrent < 1):
            raise ValueError(f"Group.concurrent must be a positive integer or None, "
                             f"got {self.concurrent!r}")

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return math.ceil(self.size / self.ranks_per_node)

    @classmethod
    def of_ranks(cls, ranks: Sequence[int], devices_per_node: int) -> "Group":
        """The shape of the group of global ``ranks`` (rank r lives on node r // dpn)."""
        if not ranks:
            raise ValueError("a group needs at least one rank")
        per_node = Counter(r // devices_per_node for r in ranks)
        return cls(size=len(ranks), ranks_per_node=max(per_node.values()))

    @classmethod
    def for_mesh_axis(cls, shape: Sequence[int], axis: int, devices_per_node: int) -> "Group":
        """The group along ``axis`` of a row-major device mesh (last axis fastest), e.g.
        ``for_mesh_axis((pp, dp, tp), 1, 8)`` is a DP group. Every group along an axis of a
        row-major mesh has the same shape, so rank 0's group stands for all."""
        stride = math.prod(shape[axis + 1:])
        return cls.of_ranks([j * stride for j in range(shape[axis])], devices_per_node)


class CommModel:
    """Alpha-beta collective times on ``cluster`` (see the module docstring)."""

    def __init__(self, cluster: Cluster,
                 fitted: Mapping[tuple[str, str], tuple[float, float]] | None = None, *,
                 measured: MeasuredCommFn | None = None):
        self.cluster = cluster
        self.measured = measured
        self.fitted: dict[tuple[str, str], tuple[float, float]] = {}
        for key, value in (fitted or {}).items():
            collective, level = key
            _check_collective(collective)
            if level not in LEVELS:
                raise ValueError(f"fitted[{key!r}]: level must be one of {LEVELS}")
            alpha, beta = value
            if not (alpha >= 0 and beta > 0):
                raise ValueError(f"fitted[{key!r}]: need alpha >= 0 and beta > 0, got {value!r}")
            self.fitted[(collective, level)] = (float(alpha), float(beta))

    # ---- pieces --------------------------------------------------------------------------
    def _check_group(self, group: Group) -> None:
        c = self.cluster
        if group.ranks_per_node > c.devices_per_node:
            raise ValueError(f"group has {group.ranks_per_node} ranks per node but "
                             f"{c.name} has {c.devices_per_node} devices per node")
        if group.nodes > c.nodes:
            raise ValueError(f"group of {group.size} ranks ({group.ranks_per_node} per node) "
                             f"spans {group.nodes} nodes; {c.name} has {c.nodes}")

    def level(self, group: Group) -> str:
        """'intra' if the group is inside one node, else 'inter'."""
        return "intra" if group.nodes == 1 else "inter"

    def bus_bandwidth(self, group: Group) -> float:
        """Bus bandwidth in bytes/s available to one such group (module docstring)."""
        self._check_group(group)
        c = self.cluster
        intra = c.intra_node.bandwidth
        if group.nodes == 1:
            return intra
        k, dpn = group.ranks_per_node, c.devices_per_node
        nic = c.inter_node.bandwidth
        concurrent = group.concurrent or max(1, dpn // k)
        bw = min(c.node_nic_bandwidth / concurrent,
                 k * nic * max(1.0, c.inter_node.nics / dpn))
        return min(bw, intra) if k > 1 else bw

    def alpha(self, collective: str, group: Group) -> float:
        """Latency term in seconds (module docstring)."""
        _check_collective(collective)
        self._check_group(group)
        if group.size <= 1:
            return 0.0
        c = self.cluster
        if collective == "send_recv":
            link = c.intra_node if group.nodes == 1 else c.inter_node
            return link.latency
        phases = 2 if collective == "all_reduce" else 1
        t = (group.ranks_per_node - 1) * c.intra_node.latency
        if group.nodes > 1:
            t += math.ceil(math.log2(group.nodes)) * c.inter_node.latency
        return phases * t

    # ---- the API the planner calls -------------------------------------------------------
    def time(self, collective: str, nbytes: float, group: Group) -> float:
        """Seconds for ``collective`` on a tensor of ``nbytes`` (full size) over ``group``."""
        _check_collective(collective)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._check_group(group)
        if group.size <= 1 or nbytes == 0:
            return 0.0
        level = self.level(group)
        if self.measured is not None:
            hit = self.measured(collective, float(nbytes), group, level)
            if hit is not None:
                return float(hit)
        factor = bus_factor(collective, group.size)
        fitted = self.fitted.get((collective, level))
        if fitted is not None:
            alpha, beta = fitted
            return alpha + nbytes * factor * beta
        return self.alpha(collective, group) + nbytes * factor / self.bus_bandwidth(group)
