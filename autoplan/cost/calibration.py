"""Calibration factors: measured runs correct the cost model, term by term.

A calibration file ``profiles/calibration/<cluster>.json`` holds one multiplicative factor
per term of a prediction, fitted by ``autoplan calibrate`` (:mod:`autoplan.calibrate`) from
engine runs on that cluster, with the runs it came from::

    {"format": "autoplan.calibration", "version": 1, "cluster": "local-cpu",
     "factors": {"compute": 1.4, "tp_comm": 2.1, "dp_comm": 0.9, "pp_comm": 1.0,
                 "memory": 1.03},
     "method": "...", "date": "...", "runs": [{...}, ...]}

Applying it to a :class:`~autoplan.plan.Prediction` (:meth:`Calibration.apply`), with f the
factors and the terms of :class:`~autoplan.plan.TimeBreakdown`::

    compute' = f_compute · compute      recompute' = f_compute · recompute
    optimizer' = f_compute · optimizer  tp_comm' = f_tp · tp_comm
    dp_comm' = f_dp · dp_comm           pp_comm' = f_pp · pp_comm
    bubble' = f_pipe · bubble,
    f_pipe = (f_compute (compute + recompute) + f_tp tp_comm + f_pp pp_comm)
             / (compute + recompute + tp_comm + pp_comm)
    step' = the sum of the terms'

The bubble is idle time waiting for other stages' forward/backward work (compute, TP and
pipeline communication), so it scales as that work does (exactly so for uniform stages,
where the pipeline takes (m + p - 1) stage-micro-batches). Memory: the ``memory`` factor
multiplies each stage's total, the difference going to ``other`` (allocator slack and buffers
the model does not list). Throughput figures follow the step time.

A missing file, or a factor the file lacks, is 1: an uncalibrated cluster is predicted as
before.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from autoplan.plan import MemoryBreakdown, Prediction, TimeBreakdown, atomic_write_text
from autoplan.profile.files import ProfileError, read_json

FORMAT = "autoplan.calibration"
VERSION = 1
TIME_TERMS = ("compute", "tp_comm", "dp_comm", "pp_comm")
TERMS = (*TIME_TERMS, "memory")
#: Factors outside this range are refused: a model that far off needs fixing, not scaling.
FACTOR_RANGE = (0.05, 50.0)


@dataclass(frozen=True)
class Calibration:
    """Factors per term (module docstring); ``runs`` record what they were fitted to."""

    cluster: str
    factors: Mapping[str, float] = field(default_factory=dict)
    method: str = ""
    date: str = ""
    runs: tuple[Mapping[str, Any], ...] = ()
    source: str | None = None          # the file it was loaded from

    def __post_init__(self) -> None:
        clean = {}
        for key, value in dict(self.factors).items():
            if key not in TERMS:
                raise ProfileError(f"unknown term {key!r}; known: {list(TERMS)}",
                                   source=self.source or "<calibration>",
                                   field=f"factors.{key}")
            lo, hi = FACTOR_RANGE
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not lo <= value <= hi:
                raise ProfileError(f"must be a number in [{lo}, {hi}], got {value!r}",
                                   source=self.source or "<calibration>",
                                   field=f"factors.{key}")
            clean[key] = float(value)
        object.__setattr__(self, "factors", MappingProxyType(clean))

    def factor(self, term: str) -> float:
        if term not in TERMS:
            raise ValueError(f"unknown term {term!r}; known: {list(TERMS)}")
        return self.factors.get(term, 1.0)

    @property
    def is_identity(self) -> bool:
        return all(v == 1.0 for v in self.factors.values())

    # ---- applying ----------------------------------------------------------------------
    def time(self, t: TimeBreakdown) -> TimeBreakdown:
        """The breakdown with every term scaled (module docstring)."""
        fc, ftp, fdp, fpp = (self.factor(k) for k in TIME_TERMS)
        work = t.compute + t.recompute + t.tp_comm + t.pp_comm
        f_pipe = ((fc * (t.compute + t.recompute) + ftp * t.tp_comm + fpp * t.pp_comm) / work
                  if work > 0 else fc)
        return TimeBreakdown(compute=fc * t.compute, recompute=fc * t.recompute,
                             tp_comm=ftp * t.tp_comm, dp_comm=fdp * t.dp_comm,
                             pp_comm=fpp * t.pp_comm, bubble=f_pipe * t.bubble,
                             optimizer=fc * t.optimizer)

    def memory(self, m: MemoryBreakdown) -> MemoryBreakdown:
        f = self.factor("memory")
        return replace(m, other=m.other + (f - 1.0) * m.total)

    def apply(self, pred: Prediction) -> Prediction:
        """``pred`` with the factors applied (itself when they are all 1)."""
        if self.is_identity:
            return pred
        time = self.time(pred.time)
        ratio = pred.step_time_s / time.total if time.total > 0 else 1.0
        return replace(pred, step_time_s=time.total, time=time,
                       tokens_per_s=pred.tokens_per_s * ratio,
                       samples_per_s=pred.samples_per_s * ratio,
                       model_tflops_per_device=pred.model_tflops_per_device * ratio,
                       hardware_tflops_per_device=pred.hardware_tflops_per_device * ratio,
                       mfu=pred.mfu * ratio, memory=self.memory(pred.memory),
                       memory_per_stage=tuple(self.memory(m) for m in pred.memory_per_stage))

    # ---- files -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "cluster": self.cluster,
                "factors": dict(self.factors), "method": self.method, "date": self.date,
                "runs": [dict(r) for r in self.runs]}

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> "Calibration":
        if not isinstance(d, dict):
            raise ProfileError(f"must be a JSON object, got {type(d).__name__}", source=source)
        if d.get("format") != FORMAT:
            raise ProfileError(f"is not a calibration file (format {d.get('format')!r}, "
                               f"expected {FORMAT!r})", source=source, field="format")
        if d.get("version") != VERSION:
            raise ProfileError(f"version {d.get('version')!r} is not supported (this autoplan "
                               f"reads version {VERSION})", source=source, field="version")
        known = {"format", "version", "cluster", "factors", "method", "date", "runs"}
        for key in d:
            if key not in known:
                raise ProfileError(f"unknown key; known: {sorted(known)}", source=source,
                                   field=key)
        if not isinstance(d.get("cluster"), str) or not d["cluster"]:
            raise ProfileError("must be the cluster's name", source=source, field="cluster")
        factors = d.get("factors", {})
        if not isinstance(factors, dict):
            raise ProfileError("must be an object of term -> factor", source=source,
                               field="factors")
        runs = d.get("runs", [])
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise ProfileError("must be a list of objects", source=source, field="runs")
        return cls(cluster=d["cluster"], factors=factors, method=str(d.get("method", "")),
                   date=str(d.get("date", "")), runs=tuple(runs), source=source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        return cls.from_dict(read_json(path), source=str(path))

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a reader never sees half a file)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")


def calibration_path(cluster: str, root: str | os.PathLike) -> Path:
    """``<profiles>/calibration/<cluster>.json``."""
    return Path(root) / "calibration" / f"{cluster}.json"


def load_calibration(cluster: str, root: str | os.PathLike) -> Calibration:
    """The cluster's calibration, or the identity if it has none."""
    path = calibration_path(cluster, root)
    if not path.exists():
        return Calibration(cluster=cluster)
    cal = Calibration.load(path)
    if cal.cluster != cluster:
        raise ProfileError(f"calibrates cluster {cal.cluster!r}, not {cluster!r}",
                           source=str(path), field="cluster")
    return cal


# ---- fitting -------------------------------------------------------------------------------

def design_row(t: TimeBreakdown) -> dict[str, float]:
    """Seconds of ``t`` that each time factor multiplies, bubble apportioned as
    :meth:`Calibration.time` scales it: step' = sum_k f_k · row[k]."""
    work = t.compute + t.recompute + t.tp_comm + t.pp_comm
    share = (lambda x: t.bubble * x / work) if work > 0 else (lambda x: 0.0)
    c = t.compute + t.recompute
    return {"compute": c + t.optimizer + (share(c) if work > 0 else t.bubble),
            "tp_comm": t.tp_comm + share(t.tp_comm), "dp_comm": t.dp_comm,
            "pp_comm": t.pp_comm + share(t.pp_comm)}


def fit_time_factors(rows: list[dict[str, float]], measured: list[float], *,
                     ridge: float = 1e-3, min_share: float = 0.02) -> dict[str, float]:
    """Factors f minimising the squared *relative* error of the runs plus a pull to 1::

        sum_r ((sum_k f_k a_rk - y_r) / y_r)^2 + ridge · sum_k (f_k - 1)^2

    (``a_rk`` = ``rows[r][k]``, y the measured step times). A term whose seconds are under
    ``min_share`` of every run's step is not identifiable from these runs and keeps 1. Factors
    are kept within :data:`FACTOR_RANGE`: one that would leave it is pinned to the bound and
    the rest refitted. Linear least squares (numpy), so the fit is exact on data the model
    explains with some factors."""
    import numpy as np

    if len(rows) != len(measured) or not rows:
        raise ValueError("need one measured step time per row, and at least one row")
    if any(not y > 0 for y in measured):
        raise ValueError("measured step times must be positive")
    y = np.asarray(measured, dtype=float)
    a = np.array([[row.get(k, 0.0) for k in TIME_TERMS] for row in rows], dtype=float) \
        / y[:, None]
    free = [j for j, _ in enumerate(TIME_TERMS) if np.max(a[:, j]) >= min_share]
    fixed: dict[int, float] = {j: 1.0 for j in range(len(TIME_TERMS)) if j not in free}
    lo, hi = FACTOR_RANGE
    while True:
        cols = [j for j in free if j not in fixed]
        target = np.ones(len(y)) - sum(a[:, j] * v for j, v in fixed.items())
        design = np.vstack([a[:, cols], np.sqrt(ridge) * np.eye(len(cols))])
        rhs = np.concatenate([target, np.sqrt(ridge) * np.ones(len(cols))])
        sol = np.linalg.lstsq(design, rhs, rcond=None)[0] if cols else np.array([])
        out = dict(zip(cols, sol))
        bad = [(j, v) for j, v in out.items() if not lo <= v <= hi]
        if not bad:
            break
        j, v = max(bad, key=lambda jv: abs(np.log(max(jv[1], 1e-9))))
        fixed[j] = lo if v < lo else hi
    out.update(fixed)
    return {TIME_TERMS[j]: float(out[j]) for j in range(len(TIME_TERMS))}


def fit_memory_factor(predicted: list[float], measured: list[float]) -> float:
    """The geometric mean of measured / predicted peak memory (1 with no data)."""
    import math

    pairs = [(p, m) for p, m in zip(predicted, measured) if p and m and p > 0 and m > 0]
    if not pairs:
        return 1.0
    lo, hi = FACTOR_RANGE
    f = math.exp(sum(math.log(m / p) for p, m in pairs) / len(pairs))
    return min(hi, max(lo, f))
