"""Alpha-beta fit of collective timings, in nccl-tests' bus-bandwidth terms.

nccl-tests (NVIDIA, ``doc/PERFORMANCE.md``) reports for a collective over ``n`` ranks moving
``S`` bytes (the full buffer) in time ``t``:

* algorithm bandwidth ``algbw = S / t``;
* bus bandwidth ``busbw = algbw · factor(n)``, with ``factor`` = ``2(n-1)/n`` for all-reduce,
  ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, and ``1`` for send/recv —
  the bytes each rank must move over its link for a bandwidth-optimal (ring) algorithm,
  so busbw is comparable across collectives and group sizes and bounded by the link speed.

The time model (Hockney's alpha-beta, as in Alpa's and Megatron's cost models) is then

    t(S, n) = alpha + S · factor(n) / busbw = alpha + x · beta,   x = S · factor(n)

fitted by weighted least squares on the design matrix ``[1, x]``. Rows are weighted by
``sqrt(w)/t`` (relative error), with ``w = 1 + x / 1 MB`` so that messages of a megabyte
and more, where bandwidth dominates, count more than the many latency-bound small ones. A
negative alpha (noise on tiny messages) is clamped to zero and beta refitted alone.

One line does not always follow a link over six decades of sizes: NCCL switches protocols
(LL, LL128, Simple) with the size, and on a CPU "link" (gloo over loopback, i.e. memcpy)
messages that fit in the caches move faster than those that stream from DRAM.
:func:`fit_segments` therefore also fits a piecewise model — the same alpha-beta form on
contiguous size ranges — with the fewest segments (up to 3, each of >= 3 sizes, breaking
only at 64 KiB and above: below, everything is latency) whose largest relative error on
the points of >= 1 MB is within 15%; breakpoints by dynamic programming over the sorted
sizes, minimising the weighted squared relative error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplan.errors import AutoplanError

MB = 1 << 20


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``collective`` over ``n`` ranks."""
    if n < 1:
        raise AutoplanError(f"group size must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "send_recv":
        return 1.0
    raise AutoplanError(f"unknown collective {collective!r}; known: all_reduce, all_gather, "
                        "reduce_scatter, all_to_all, send_recv")


@dataclass(frozen=True)
class AlphaBeta:
    """``t = alpha_s + bus_bytes / (busbw_gbps · 1e9)`` (bus bytes = S · factor)."""

    alpha_s: float
    busbw_gbps: float

    def predict(self, collective: str, nbytes: np.ndarray | float, n: np.ndarray | int
                ) -> np.ndarray:
        factor = np.vectorize(bus_factor)(collective, n)
        return self.alpha_s + np.asarray(nbytes, dtype=float) * factor / (self.busbw_gbps * 1e9)


def fit_alpha_beta(collective: str, nbytes: np.ndarray, group_size: np.ndarray,
                   time_s: np.ndarray) -> AlphaBeta:
    """Weighted least-squares alpha-beta fit (module docstring). Exact on affine data."""
    nbytes = np.asarray(nbytes, dtype=float)
    time_s = np.asarray(time_s, dtype=float)
    if nbytes.shape != time_s.shape or nbytes.size < 2:
        raise AutoplanError(f"{collective}: need >= 2 (bytes, time) points to fit, got "
                            f"{nbytes.size}")
    if np.any(time_s <= 0):
        raise AutoplanError(f"{collective}: times must be positive")
    x = nbytes * np.vectorize(bus_factor)(collective, np.broadcast_to(group_size, nbytes.shape))
    w = np.sqrt(1.0 + x / MB) / time_s
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, time_s * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.dot(x * w, time_s * w) / np.dot(x * w, x * w))
    if not beta > 0:
        raise AutoplanError(f"{collective}: time does not grow with message size over "
                            f"{nbytes.min():.0f}..{nbytes.max():.0f} bytes; cannot fit a "
                            "bandwidth")
    return AlphaBeta(alpha_s=float(alpha), busbw_gbps=float(1.0 / beta / 1e9))


def max_relative_error(fit: AlphaBeta, collective: str, nbytes: np.ndarray,
                       group_size: np.ndarray, time_s: np.ndarray, *, min_bytes: int = MB
                       ) -> float | None:
    """max |predicted - measured| / measured over points with ``bytes >= min_bytes``."""
    nbytes = np.asarray(nbytes, dtype=float)
    keep = nbytes >= min_bytes
    if not keep.any():
        return None
    n = np.broadcast_to(np.asarray(group_size), nbytes.shape)[keep]
    pred = fit.predict(collective, nbytes[keep], n)
    meas = np.asarray(time_s, dtype=float)[keep]
    return float(np.max(np.abs(pred - meas) / meas))


@dataclass(frozen=True)
class SegmentFit:
    """An alpha-beta fit valid for messages of ``min_bytes`` .. ``max_bytes``."""

    min_bytes: int
    max_bytes: int
    fit: AlphaBeta


def fit_segments(collective: str, nbytes: np.ndarray, group_size: np.ndarray,
                 time_s: np.ndarray, *, max_segments: int = 3, min_sizes: int = 3,
                 target: float = 0.15, min_break: int = 64 * 1024) -> list[SegmentFit]:
    """Piecewise alpha-beta fit over message-size ranges (module docstring)."""
    nbytes = np.asarray(nbytes, dtype=float)
    group_size = np.broadcast_to(np.asarray(group_size), nbytes.shape)
    time_s = np.asarray(time_s, dtype=float)
    sizes = np.unique(nbytes)
    m = len(sizes)
    cost: dict[tuple[int, int], tuple[float, AlphaBeta] | None] = {}

    def segment(i: int, j: int) -> tuple[float, AlphaBeta] | None:
        """Fit of sizes[i:j] and its weighted squared relative error (None: no fit)."""
        if (i, j) not in cost:
            keep = (nbytes >= sizes[i]) & (nbytes <= sizes[j - 1])
            try:
                ab = fit_alpha_beta(collective, nbytes[keep], group_size[keep], time_s[keep])
            except AutoplanError:
                cost[(i, j)] = None
            else:
                x = nbytes[keep]
                rel = (ab.predict(collective, x, group_size[keep]) - time_s[keep]) / time_s[keep]
                cost[(i, j)] = (float(np.sum((1.0 + x / MB) * rel ** 2)), ab)
        return cost[(i, j)]

    best: list[SegmentFit] = []
    for k in range(1, max_segments + 1):
        first_break = int(np.searchsorted(sizes, min_break))
        split = _best_split(m, k, min_sizes, segment, first_break)
        if split is None:
            continue
        best = [SegmentFit(int(sizes[i]), int(sizes[j - 1]), segment(i, j)[1]) for i, j in split]
        if (segmented_error(best, collective, nbytes, group_size, time_s) or 0.0) <= target:
            break
    return best


def _best_split(m: int, k: int, min_sizes: int, segment, first_break: int
                ) -> list[tuple[int, int]] | None:
    """Cut sizes[0:m] into k contiguous runs of >= min_sizes, cutting nowhere below index
    ``first_break``, minimising the summed cost."""
    inf = float("inf")
    table = [[(inf, -1)] * (m + 1) for _ in range(k + 1)]
    table[0][0] = (0.0, -1)
    for seg in range(1, k + 1):
        for j in range(seg * min_sizes, m + 1):
            for i in range((seg - 1) * min_sizes, j - min_sizes + 1):
                if 0 < i < first_break:
                    continue
                prev = table[seg - 1][i][0]
                fit = segment(i, j) if prev < inf else None
                if fit is not None and prev + fit[0] < table[seg][j][0]:
                    table[seg][j] = (prev + fit[0], i)
    if table[k][m][0] == inf:
        return None
    cuts, j = [], m
    for seg in range(k, 0, -1):
        i = table[seg][j][1]
        cuts.append((i, j))
        j = i
    return cuts[::-1]


def segment_for(segments: list[SegmentFit], nbytes: float) -> SegmentFit:
    """The segment whose range holds ``nbytes`` (the first below, the last above all)."""
    chosen = segments[0]
    for seg in segments:
        if nbytes >= seg.min_bytes:
            chosen = seg
    return chosen


def segmented_error(segments: list[SegmentFit], collective: str, nbytes: np.ndarray,
                    group_size: np.ndarray, time_s: np.ndarray, *, min_bytes: int = MB
                    ) -> float | None:
    """max relative error of the piecewise model over points with ``bytes >= min_bytes``."""
    worst = None
    for b, n, t in zip(np.asarray(nbytes, dtype=float), np.broadcast_to(group_size, np.shape(nbytes)),
                       np.asarray(time_s, dtype=float)):
        if b >= min_bytes:
            pred = float(segment_for(segments, b).fit.predict(collective, b, n))
            worst = max(worst or 0.0, abs(pred - t) / t)
    return worst
