"""Measured op times for the cost model: exact match, interpolation, or "use the roofline".

    table = OpTimeTable.load("profiles/ops/cpu-amd-epyc.json")
    fwd_s, bwd_s = table.lookup(node, shard=2) or roofline(node)
    table.last_source          # "exact" | "interpolated" | "roofline"

``shard`` is the tensor-parallel degree ``t`` dividing the op (``1`` = whole op); a value
below 1 is read as the fraction ``1/t``. The signature one rank runs is worked out as the
profiler does (:func:`autoplan.profile.replay.sharded_call`), then:

1. **exact** — that signature was measured: its median times;
2. **interpolated** — measured entries of the same op, dtype and input ranks exist: their
   times are interpolated log-linearly in work ``x`` (FLOPs by torch.utils.flop_counter when
   the op has any, else bytes of inputs + outputs)::

       log t = log t_i + (log x - log x_i) / (log x_j - log x_i) · (log t_j - log t_i)

   between the neighbours ``x_i <= x <= x_j``; outside the measured range, by at most a
   factor ``extrapolate``, along the log-log slope of the two nearest entries clipped to
   ``[0, 1]`` (time never falls with work nor grows faster than it; with a single entry,
   constant below it and proportional above it);
3. **roofline** — otherwise ``None``: the cost model falls back to its roofline.

Entries whose backward could not be run (``bwd_s: null``) count as missing. With
``dtype="bfloat16"`` the floating tensors of every node are looked up as that dtype (a graph
traced in float32 planned for bf16 compute).
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from autoplan.graph import OpNode
from autoplan.profile.signature import Signature, shard_candidates, tp_degree
from autoplan.profile.store import OpEntry, OpProfile

if TYPE_CHECKING:          # replaying ops needs torch; reading a profile does not
    from autoplan.profile.replay import Call

Source = Literal["exact", "interpolated", "roofline"]


@dataclass(frozen=True)
class Lookup:
    fwd_s: float | None
    bwd_s: float | None
    source: Source
    key: str                           # the (sharded) signature looked up
    neighbours: tuple[str, ...] = ()   # entries interpolated between


class OpTimeTable:
    """Op times from an :class:`~autoplan.profile.store.OpProfile` (module docstring).

    ``last_source`` is the source of the latest lookup and ``counts`` tallies every
    lookup's source, so a report can say how much of a prediction was measured.
    """

    def __init__(self, profile: OpProfile, *, extrapolate: float = 2.0,
                 dtype: str | None = None):
        if extrapolate < 1:
            raise ValueError(f"extrapolate must be >= 1, got {extrapolate}")
        self.profile = profile
        self.extrapolate = extrapolate
        self.dtype = dtype
        self.last_source: Source | None = None
        self.counts: Counter[str] = Counter()
        self._groups: dict[tuple, list[OpEntry]] = defaultdict(list)
        for e in profile.entries.values():
            if e.bwd_s is not None:
                self._groups[_group(e.op, e.dtype, e.inputs)].append(e)
        self._resolved: dict[tuple[str, str, int], tuple[Signature, Call | None]] = {}
        self._found: dict[tuple[str, str, int], Lookup] = {}

    @classmethod
    def load(cls, path: str | os.PathLike, **kwargs) -> "OpTimeTable":
        return cls(OpProfile.load(path), **kwargs)

    @property
    def device(self) -> str:
        return self.profile.device

    def lookup(self, node: OpNode, shard: float = 1.0) -> tuple[float, float] | None:
        """(forward s, backward s) of ``node`` split ``shard`` ways, or None (roofline)."""
        found = self.explain(node, shard)
        if found.fwd_s is None or found.bwd_s is None:
            return None
        return found.fwd_s, found.bwd_s

    def explain(self, node: OpNode, shard: float = 1.0) -> Lookup:
        """Like :meth:`lookup`, with the source and the entries used."""
        t = tp_degree(shard)
        memo = (Signature.of(node).key, node.tp_role, t)
        result = self._found.get(memo)
        if result is None:
            result = self._found[memo] = self._find(node, t)
        self.last_source = result.source
        self.counts[result.source] += 1
        return result

    # ---- internals ---------------------------------------------------------------------
    def _find(self, node: OpNode, t: int) -> Lookup:
        base = self._signature(node)
        group = self._groups.get(_group(base.op, base.dtype, base.inputs), [])
        if not group:
            # Nothing of this op, dtype and input ranks was measured (sharding keeps all
            # three): the roofline, without reconstructing the call (a replay search of up
            # to MAX_TRIALS meta calls per shard candidate, seconds for a convolution).
            shard = next(iter(shard_candidates(base, node.tp_role, t)), base) if t > 1 \
                else base
            return Lookup(None, None, "roofline", shard.key)
        sig, call = self._resolve(node, t)
        entry = self.profile.entries.get(sig.key)
        if entry is not None and entry.bwd_s is not None:
            return Lookup(entry.fwd_s, entry.bwd_s, "exact", sig.key, (sig.key,))
        use_flops = all(e.flops > 0 for e in group)
        if use_flops:
            from autoplan.profile.replay import count_flops

            flops = count_flops(call, sig) if call is not None else node.fwd_flops / t
            use_flops = flops > 0
        x = flops if use_flops else float(sig.bytes)
        pts = _aggregate([((e.flops if use_flops else float(e.bytes)), e.fwd_s, e.bwd_s, e.key)
                          for e in group])
        got = _interpolate(pts, x, self.extrapolate)
        if got is None:
            return Lookup(None, None, "roofline", sig.key)
        fwd, bwd, used = got
        return Lookup(fwd, bwd, "interpolated", sig.key, used)

    def _signature(self, node: OpNode) -> Signature:
        sig = Signature.of(node)
        return sig if self.dtype is None else sig.with_float_dtype(self.dtype)

    def _resolve(self, node: OpNode, t: int) -> tuple[Signature, Call | None]:
        sig = self._signature(node)
        memo = (sig.key, node.tp_role, t)
        if memo not in self._resolved:
            from autoplan.profile.replay import ReplayError, sharded_call

            try:
                self._resolved[memo] = sharded_call(sig, node.tp_role, t)
            except ReplayError:
                shard = next(iter(shard_candidates(sig, node.tp_role, t)), sig)
                self._resolved[memo] = (shard, None)
        return self._resolved[memo]


def _group(op: str, dtype: str, inputs) -> tuple:
    return (op, dtype, tuple(len(t.shape) for t in inputs))


def _aggregate(points: list[tuple[float, float, float, str]]
               ) -> list[tuple[float, float, float, tuple[str, ...]]]:
    """Sorted by work; entries of equal work merged (median times)."""
    by_x: dict[float, list[tuple[float, float, str]]] = defaultdict(list)
    for x, f, b, k in points:
        if x > 0:
            by_x[x].append((f, b, k))
    out = []
    for x in sorted(by_x):
        rows = sorted(by_x[x])
        mid = rows[len(rows) // 2]
        out.append((x, mid[0], mid[1], tuple(r[2] for r in rows)))
    return out


def _interpolate(pts, x: float, extrapolate: float
                 ) -> tuple[float, float, tuple[str, ...]] | None:
    if not pts or x <= 0:
        return None
    xs = [p[0] for p in pts]
    if xs[0] <= x <= xs[-1]:
        j = next(i for i, v in enumerate(xs) if v >= x)
        if xs[j] == x:
            return pts[j][1], pts[j][2], pts[j][3]
        lo, hi = pts[j - 1], pts[j]
        w = math.log(x / lo[0]) / math.log(hi[0] / lo[0])
        return (_loglerp(lo[1], hi[1], w), _loglerp(lo[2], hi[2], w), lo[3] + hi[3])
    if x > xs[-1]:
        if x > xs[-1] * extrapolate:
            return None
        near, far, default_slope = pts[-1], (pts[-2] if len(pts) > 1 else None), 1.0
    else:
        if x < xs[0] / extrapolate:
            return None
        near, far, default_slope = pts[0], (pts[1] if len(pts) > 1 else None), 0.0
    ratio = x / near[0]
    fwd = near[1] * ratio ** _slope(near, far, 1, default_slope)
    bwd = near[2] * ratio ** _slope(near, far, 2, default_slope)
    return fwd, bwd, near[3]


def _slope(near, far, idx: int, default: float) -> float:
    if far is None or near[idx] <= 0 or far[idx] <= 0:
        return default
    s = math.log(far[idx] / near[idx]) / math.log(far[0] / near[0])
    return min(1.0, max(0.0, s))


def _loglerp(a: float, b: float, w: float) -> float:
    """Interpolate between times ``a`` and ``b`` in log space (linear if either is 0)."""
    if a <= 0 or b <= 0:
        return a + (b - a) * w
    return math.exp(math.log(a) + w * (math.log(b) - math.log(a)))
