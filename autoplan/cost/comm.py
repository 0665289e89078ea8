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

Algorithms, protocols and latency: NCCL's own tuning model. Without a measured or fitted
profile, all-reduce, all-gather and reduce-scatter are priced as NCCL prices them when it
picks an algorithm and protocol (NVIDIA/nccl ``src/graph/tuning.cc``: ``ncclTopoTuneModel``
and ``ncclTopoGetAlgoTime``, NCCL 2.1x): for each enabled (algorithm, protocol) a line
``t = lat + S / algbw`` and the fastest wins (:func:`nccl_time`).

* **Ring** (every collective): ``nsteps`` = 2(n-1) (all-reduce) or n-1 (all-gather,
  reduce-scatter) steps, ``n_inter`` = 2(nodes-1) or nodes-1 of them cross the network::

      lat = base[p] + (nsteps - n_inter) * hw[intra][p] + n_inter * hw[net][p]

  so the latency grows *linearly* with the number of ranks (a ring all-gather over 1,536
  GPUs on 192 nodes pays 1,535 steps). Multi-node Simple all-reduce pays 1.9x its latency
  once the message reaches n/16 x 64 KiB (NCCL's "plateau effect of ring").
* **Tree** (all-reduce only, NCCL's double binary tree): latency grows with log2(nodes)::

      lat = base[p] + 2 ((k - 1) hw[intra][p] + log2(nodes) hw[net][p])

  with bus bandwidth 0.9 x the ring's, capped at 80 GB/s (Simple) / 105 GB/s (LL128) beyond
  two nodes, and NCCL's per-size correction factor (0.5-1.0) for medium messages.
* **NVLS** (NVLink SHARP, H100 NVSwitch, all-reduce inside a node): the switch reduces, so
  a rank moves each byte about once instead of 2(n-1)/n times: nccl-tests measure ~480 GB/s
  busbw against ~370 GB/s for the ring on 8 H100 (published.md). Priced where the cluster's
  device is a Hopper part on NVSwitch, with the ring busbw scaled by the measured 480/370.
* **Protocols**: LL (8-byte flag+data lines: 1/4 of the ring's bandwidth across nodes or for
  all-reduce, 1/3 otherwise; 1/3.8 for tree), LL128 (0.92 of it with >= 2 ranks per node,
  0.7 with one; 0.915 for tree across nodes, 7/9 inside one) and Simple (full bandwidth, the
  largest latency). The cluster's ``bandwidth_gbps`` is the Simple ring's measured busbw.

Latencies (us), ``base`` {LL, LL128, Simple}: ring 3.6, 10.0, 8.4; tree 4.4, 4.4, 0.
``hw`` per step, NVLink: ring 0.47, 1.9, 3.4; tree 0.52, 1.2, 28; network: ring 2.7, 4.0, 9.6;
tree 5.0, 8.5, 50 (LL's intra-node step x1.8 across nodes). These are NCCL's constants, so
the small-message regime follows NCCL's choices (LL/LL128 below ~1 MB, Simple above, tree
across many nodes); the large-message regime is the cluster's measured busbw, as before.
``send_recv`` and ``all_to_all`` keep one step at the link's own latency (``latency_us``).

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
#: collectives priced by NCCL's algorithm/protocol model (the others: one alpha-beta line)
NCCL_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")

#: ``fn(collective, nbytes, group, level)`` -> seconds, or None (see the module docstring).
MeasuredCommFn = Callable[[str, float, "Group", str], "float | None"]


PROTOCOLS = ("LL", "LL128", "Simple")
#: NCCL tuning.cc: base latency (us) per algorithm and protocol {LL, LL128, Simple}
NCCL_BASE_LAT_US = {"ring": (3.6, 10.0, 8.4), "tree": (4.4, 4.4, 0.0)}
#: NCCL tuning.cc: latency (us) per algorithm step, per hardware level and protocol
NCCL_HW_LAT_US = {
    "intra": {"ring": (0.47, 1.9, 3.4), "tree": (0.52, 1.2, 28.0)},
    "inter": {"ring": (2.7, 4.0, 9.6), "tree": (5.0, 8.5, 50.0)},
}
#: NCCL tuning.cc: tree bus-bandwidth caps beyond two nodes (GB/s): Simple, LL128 (A100)
NCCL_TREE_CAP_GBPS = {"Simple": 80.0, "LL128": 105.0, "LL": 80.0}
#: NCCL tuning.cc ``treeCorrectionFactor``: tree bandwidth factor by log2(bytes / 64)
NCCL_TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9,
           1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7,
              .8, .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7,
               .8, .9),
}
#: NVLink SHARP over ring all-reduce busbw on 8 H100 SXM (nccl-tests, published.md: 480/370)
NVLS_SPEEDUP = 480.0 / 370.0


def nccl_lines(collective: str, n: int, ranks_per_node: int, busbw: float, *,
               nvls: bool = False) -> tuple[tuple[str, str, float, float, float], ...]:
    """NCCL's candidate (algorithm, protocol, latency_s, bus bandwidth B/s, plateau bytes)
    lines for ``collective`` over ``n`` ranks, ``ranks_per_node`` per node, on a link whose
    Simple ring busbw is ``busbw`` (module docstring; NVIDIA/nccl src/graph/tuning.cc).
    ``plateau bytes``: from this size on the latency is 1.9x (multi-node Simple ring
    all-reduce), else inf."""
    nodes = math.ceil(n / ranks_per_node)
    k = ranks_per_node
    out = []
    if collective == "all_reduce":
        nsteps, n_inter = 2 * (n - 1), 2 * (nodes - 1)
    else:
        nsteps, n_inter = n - 1, nodes - 1
    for pi, proto in enumerate(PROTOCOLS):
        intra = NCCL_HW_LAT_US["intra"]["ring"][pi] * (1.8 if nodes > 1 and proto == "LL"
                                                       else 1.0)
        if nodes == 1:
            lat = NCCL_BASE_LAT_US["ring"][pi] + nsteps * intra
        else:
            lat = (NCCL_BASE_LAT_US["ring"][pi] + (nsteps - n_inter) * intra
                   + n_inter * NCCL_HW_LAT_US["inter"]["ring"][pi])
        if proto == "LL":
            bw = busbw / (4.0 if nodes > 1 or collective == "all_reduce" else 3.0)
        elif proto == "LL128":
            bw = busbw * (0.7 if k < 2 and nodes > 1 else 0.92)
        else:
            bw = busbw
        plateau = n / 16.0 * 65536 if (proto == "Simple" and nodes > 1
                                       and collective == "all_reduce") else math.inf
        out.append(("ring", proto, lat * 1e-6, bw, plateau))
    if collective == "all_reduce" and nodes > 1:
        for pi, proto in enumerate(PROTOCOLS):
            intra = NCCL_HW_LAT_US["intra"]["tree"][pi] * (1.8 if proto == "LL" else 1.0)
            lat = NCCL_BASE_LAT_US["tree"][pi] + 2 * (
                (k - 1) * intra + max(1, int(math.log2(nodes))) * NCCL_HW_LAT_US["inter"]["tree"][pi])
            bw = busbw * 0.9
            if nodes > 2:
                bw = min(bw, NCCL_TREE_CAP_GBPS[proto] * 1e9)
            if proto == "LL":
                bw /= 3.8
            elif proto == "LL128":
                bw *= 0.915
            out.append(("tree", proto, lat * 1e-6, bw, math.inf))
    if nvls and collective == "all_reduce" and nodes == 1:
        ring_simple = out[2]
        out.append(("nvls", "Simple", ring_simple[2], busbw * NVLS_SPEEDUP, math.inf))
    return tuple(out)


def nccl_time(collective: str, nbytes: float, n: int, lines) -> tuple[float, str, str]:
    """(seconds, algorithm, protocol) of the fastest of NCCL's ``lines`` for a tensor of
    ``nbytes`` (full size): t = lat + nbytes * bus_factor / busbw, the tree's bandwidth
    times NCCL's correction factor for the message size."""
    factor = bus_factor(collective, n)
    best = (math.inf, "", "")
    log_size = int(math.log2(max(nbytes, 64) / 64))
    for algo, proto, lat, bw, plateau in lines:
        if algo == "tree" and log_size < 22:
            bw *= NCCL_TREE_CORRECTION[proto][log_size]
        t = lat * (1.9 if nbytes >= plateau else 1.0) + nbytes * factor / bw
        if t < best[0]:
            best = (t, algo, proto)
    return best


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
    """Collective times on ``cluster`` (see the module docstring). Not one alpha-beta line
    per (collective, group): NCCL's model picks an algorithm and protocol per message size,
    so callers ask :meth:`time` (``planner.costs.CostModel.coll`` does)."""

    def __init__(self, cluster: Cluster,
                 fitted: Mapping[tuple[str, str], tuple[float, float]] | None = None, *,
                 measured: MeasuredCommFn | None = None):
        self.cluster = cluster
        self.measured = measured
        self.fitted: dict[tuple[str, str], tuple[float, float]] = {}
        self._line_cache: dict[tuple[str, Group], tuple] = {}
        # time() is pure in its arguments once the model is built; the planners ask the same
        # (collective, size, group) tens of thousands of times per search
        self._time_cache: dict[tuple[str, float, Group], float] = {}
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
        """Latency term in seconds: for all-reduce, all-gather and reduce-scatter the
        smallest of NCCL's candidate latencies (a tiny message's time); one step at the
        link's latency for send_recv and all_to_all (module docstring)."""
        _check_collective(collective)
        self._check_group(group)
        if group.size <= 1:
            return 0.0
        c = self.cluster
        if collective in NCCL_COLLECTIVES:
            return min(line[2] for line in self._lines(collective, group))
        if collective == "send_recv":
            link = c.intra_node if group.nodes == 1 else c.inter_node
            return link.latency
        t = (group.ranks_per_node - 1) * c.intra_node.latency
        if group.nodes > 1:
            t += math.ceil(math.log2(group.nodes)) * c.inter_node.latency
        return t

    def _lines(self, collective: str, group: Group):
        key = (collective, group)
        hit = self._line_cache.get(key)
        if hit is None:
            c = self.cluster
            nvls = (group.nodes == 1 and c.intra_node.kind == "nvswitch"
                    and getattr(c.device, "family", "") == "hopper")
            hit = nccl_lines(collective, group.size, group.ranks_per_node,
                             self.bus_bandwidth(group), nvls=nvls)
            self._line_cache[key] = hit
        return hit

    def algorithm(self, collective: str, nbytes: float, group: Group) -> tuple[str, str]:
        """(algorithm, protocol) NCCL's model picks for this message (module docstring)."""
        return nccl_time(collective, nbytes, group.size, self._lines(collective, group))[1:]

    # ---- the API the planner calls -------------------------------------------------------
    def time(self, collective: str, nbytes: float, group: Group) -> float:
        """Seconds for ``collective`` on a tensor of ``nbytes`` (full size) over ``group``."""
        key = (collective, nbytes, group)
        hit = self._time_cache.get(key)
        if hit is None:
            hit = self._time(collective, nbytes, group)
            if len(self._time_cache) > 1_000_000:
                self._time_cache.clear()
            self._time_cache[key] = hit
        return hit

    def _time(self, collective: str, nbytes: float, group: Group) -> float:
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
        if collective in NCCL_COLLECTIVES:
            return nccl_time(collective, nbytes, group.size, self._lines(collective, group))[0]
        return self.alpha(collective, group) + nbytes * factor / self.bus_bandwidth(group)
