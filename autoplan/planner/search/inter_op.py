"""The inter-op pass: Alpa's dynamic program over pipeline stages and submeshes.

Layers are grouped into U consecutive *units* (whole layers; identical blocks clustered
evenly, :mod:`autoplan.planner.search.search`), the cluster into V equal *device units* (whole
nodes, or devices inside one node). A stage covers units [i, j) on n device units; its
latency t(s, i, j, n) (seconds per micro-batch, forward + backward, including the
per-step costs spread over the micro-batches) comes from the intra-op pass at the best
placement that fits in memory when the stage is the s-th from the end of the pipeline (1F1B
keeps min(s, m) micro-batches in flight there) — ``inf`` if nothing fits.

For m micro-batches the 1F1B / GPipe pipeline latency is (Alpa, Zheng et al. 2022, eq. 2)::

    T* = min_{stages}  sum_i t_i + (m - 1) max_i t_i

Alpa solves it by enumerating t_max and, for each, the DP (:func:`stage_dp`)::

    F(s, i, d) = min_{j > i, n <= d, t(s, i, j, n) <= t_max} t(s, i, j, n) + F(s - 1, j, d - n)
    F(0, U, 0) = 0

(s stages cover units [i, U) with exactly d device units), then T*(t_max) =
min_s F(s, 0, V) + (m - 1) t_max. Both kernels are pure functions over numpy arrays;
:func:`brute_force` enumerates every partition of a small instance to cross-check them
(tests/test_search.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

INF = math.inf


@dataclass(frozen=True)
class StagePick:
    start: int          # first unit
    end: int            # one past the last unit
    devices: int        # device units
    position: int       # s: 1 for the last stage


@dataclass(frozen=True)
class DpResult:
    latency: float                       # sum t_i + (m - 1) max t_i
    t_max: float
    stages: tuple[StagePick, ...]        # in pipeline order


def stage_dp(stage_time: np.ndarray, total_devices: int, t_max: float,
             lows: np.ndarray | None = None) -> np.ndarray:
    """F[s, i, d] (module docstring) for stage latencies ``stage_time`` of shape
    (S + 1, U, U + 1, V + 1), entries above ``t_max`` excluded; ``lows``: its minimum per
    (s, n) (``stage_time.min(axis=(1, 2))``, computed if not given)."""
    s_max1, units, _, v1 = stage_time.shape
    assert v1 == total_devices + 1
    if lows is None:
        lows = stage_time.min(axis=(1, 2))
    usable = lows <= t_max                                      # [s, n]: any entry allowed
    sizes = [n for n in range(1, v1) if usable[:, n].any()]
    f = np.full((s_max1, units + 1, v1), INF)
    f[0, units, 0] = 0.0
    for s in range(1, s_max1):
        # the units j where the stages after this one can start (inf rows change nothing)
        js = np.flatnonzero(np.isfinite(f[s - 1]).any(axis=1))
        if not js.size:
            break
        prev = f[s - 1][js]                                     # [j, d']
        for n in sizes:
            if not usable[s, n]:               # (all inf: would change nothing)
                continue
            a = stage_time[s][:, js, n]                         # [i, j]
            a = np.where(a <= t_max, a, INF)
            # best[i, d] = min_j a[i, j] + prev[j, d - n]
            best = (a[:, :, None] + prev[None, :, :v1 - n]).min(axis=1)
            np.minimum(f[s, :units, n:], best, out=f[s, :units, n:])
    return f


def _trace(stage_time: np.ndarray, f: np.ndarray, t_max: float, s: int,
           total: int) -> tuple[StagePick, ...]:
    """Walk back through F: at each step the (j, n) that attains it."""
    units = stage_time.shape[1]
    out, i, d = [], 0, total
    while s > 0:
        target = f[s, i, d]
        found = None
        for n in range(1, d + 1):
            row = stage_time[s, i, :, n]
            vals = np.where(row <= t_max, row, INF) + f[s - 1, :, d - n]
            j = int(np.argmin(vals))
            if np.isfinite(vals[j]) and abs(vals[j] - target) <= 1e-12 * max(1.0, abs(target)):
                found = (j, n)
                break
        assert found is not None and found[0] <= units
        j, n = found
        out.append(StagePick(i, j, n, s))
        i, d, s = j, d - n, s - 1
    return tuple(out)


def pipeline_dp(stage_time: np.ndarray, total_devices: int, num_micro_batches: int, *,
                max_candidates: int = 12, bound: float = INF) -> DpResult | None:
    """min over t_max of min_s F(s, 0, V) + (m - 1) t_max (module docstring); t_max runs
    over the distinct finite stage latencies (subsampled to ``max_candidates``, then
    refined between the best one's neighbours). None if no partition fits, or none is
    faster than ``bound`` (a latency already found: Alpa's early stop starts from it)."""
    finite = np.unique(stage_time[np.isfinite(stage_time)])
    if finite.size == 0:
        return None
    m = num_micro_batches
    best: DpResult | None = None

    lows = stage_time.min(axis=(1, 2))

    def run(t_max: float) -> DpResult | None:
        f = stage_dp(stage_time, total_devices, t_max, lows)
        col = f[:, 0, total_devices]
        if not np.isfinite(col).any():
            return None
        s = int(np.argmin(col))
        stages = _trace(stage_time, f, t_max, s, total_devices)
        ts = [float(stage_time[p.position, p.start, p.end, p.devices]) for p in stages]
        return DpResult(sum(ts) + (m - 1) * max(ts), t_max, stages)

    if finite.size <= max_candidates:
        grid = list(finite)
    else:
        idx = np.unique(np.linspace(0, finite.size - 1, max_candidates).round().astype(int))
        grid = list(finite[idx])
    tried: dict[float, DpResult | None] = {}
    for t_max in grid:
        if (m - 1) * t_max >= (best.latency if best is not None else bound):
            break                                   # Alpa's early stop
        tried[t_max] = r = run(t_max)
        if r is not None and r.latency < (best.latency if best is not None else bound):
            best = r
    if best is not None and finite.size > max_candidates:
        # refine: every distinct latency between the neighbours of the best grid point
        k = grid.index(best.t_max)
        lo = grid[k - 1] if k > 0 else finite[0]
        hi = grid[k + 1] if k + 1 < len(grid) else finite[-1]
        inner = finite[(finite > lo) & (finite < hi)]
        if inner.size > max_candidates:
            inner = inner[np.unique(np.linspace(0, inner.size - 1, max_candidates)
                                    .round().astype(int))]
        for t_max in inner:
            if t_max in tried or (m - 1) * t_max >= best.latency:
                continue
            r = run(float(t_max))
            if r is not None and r.latency < best.latency:
                best = r
    return best


def latency(stage_time: np.ndarray, stages: tuple[StagePick, ...], m: int) -> float:
    ts = [stage_time[p.position, p.start, p.end, p.devices] for p in stages]
    return sum(ts) + (m - 1) * max(ts)


def brute_force(stage_time: np.ndarray, total_devices: int, num_micro_batches: int
                ) -> DpResult | None:
    """Every split of the units into consecutive stages and of the device units among them
    (small instances only)."""
    s_max = stage_time.shape[0] - 1
    units = stage_time.shape[1]
    best: DpResult | None = None
    for s in range(1, s_max + 1):
        for cuts in itertools.combinations(range(1, units), s - 1):
            bounds = (0, *cuts, units)
            for devs in itertools.product(range(1, total_devices + 1), repeat=s):
                if sum(devs) != total_devices:
                    continue
                stages = tuple(StagePick(bounds[k], bounds[k + 1], devs[k], s - k)
                               for k in range(s))
                ts = [stage_time[p.position, p.start, p.end, p.devices] for p in stages]
                if not all(np.isfinite(ts)):
                    continue
                val = sum(ts) + (num_micro_batches - 1) * max(ts)
                if best is None or val < best.latency - 1e-12:
                    best = DpResult(val, max(ts), stages)
    return best
