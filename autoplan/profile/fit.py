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


def fit_link_points(points, source: str) -> tuple[list, list[str]]:
    """Fits for measured :class:`~autoplan.profile.store.LinkPoint` s: one per
    (collective, level, group size) and one pooled per (collective, level) — the pooled fit
    is what ``LinkProfile.fitted_table`` hands the cost model. Each records its max relative
    error on its own points of >= 1 MB. Returns (fits, problems): a set of points that no
    bandwidth fits (time flat in size: too few or too small messages) is reported, not
    fitted."""
    from autoplan.profile.store import LinkFit

    groups: dict[tuple[str, str, int | None], list] = {}
    for p in points:
        groups.setdefault((p.collective, p.level, p.group_size), []).append(p)
        groups.setdefault((p.collective, p.level, None), []).append(p)
    fits, problems = [], []
    for (collective, level, n), pts in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] or 0)):
        b = np.array([p.bytes for p in pts], dtype=float)
        g = np.array([p.group_size for p in pts])
        t = np.array([p.time_s for p in pts], dtype=float)
        try:
            ab = fit_alpha_beta(collective, b, g, t)
        except AutoplanError as exc:
            problems.append(f"{level} group size {n or 'all'}: {exc}")
            continue
        fits.append(LinkFit(collective=collective, level=level, group_size=n,
                            alpha_s=ab.alpha_s, busbw_gbps=ab.busbw_gbps, points=len(pts),
                            max_rel_err_ge_1mb=max_relative_error(ab, collective, b, g, t),
                            source=source))
    return fits, problems
