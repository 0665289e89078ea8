"""Profile files: measured (or published) op and link figures, as JSON data.

Two formats, both versioned, both validated on load (errors name the file and the field):

``profiles/ops/<device>.json`` — forward/backward time of each op signature on one device::

    {"format": "autoplan.op_profile", "version": 1, "device": "cpu-amd-epyc",
     "sources": {"<id>": {"kind": "measured", "host": ..., "torch": ..., "date": ...,
                          "load_avg": [..], ...}},
     "entries": {"<key>": {"op": "aten.mm.default", "dtype": "float32",
                           "inputs":  [{"dtype": "float32", "shape": [128, 64]}, ...],
                           "outputs": [{"dtype": "float32", "shape": [128, 256]}],
                           "fwd_s": 1.2e-5, "bwd_s": 2.5e-5, "repeats": 7,
                           "flops": 4194304.0, "bytes": 230400, "source": "<id>"}}}

  ``<key>`` is :meth:`OpEntry.key`: op, input dtypes and shapes, and the output shapes
  (which pin down non-tensor arguments such as the dim of a reduction). ``bwd_s`` is 0.0
  for ops with no differentiable input and ``null`` where backward could not be run.
  ``timed_as`` (optional) names the portable op that was timed where the device has no
  kernel for this one (CUDA-only attention kernels on a CPU).

``profiles/links/<cluster>.json`` — collective timings and their alpha-beta fit::

    {"format": "autoplan.link_profile", "version": 1, "cluster": "local-cpu",
     "backend": "gloo", "levels_present": ["intra"], "note": "...",
     "sources": {...},
     "points": [{"collective": "all_reduce", "group_size": 4, "level": "intra",
                 "bytes": 1048576, "time_s": ..., "algbw_gbps": ..., "busbw_gbps": ...,
                 "source": "<id>"}],
     "fits": [{"collective": "all_reduce", "level": "intra", "group_size": 4 | null,
               "alpha_s": ..., "busbw_gbps": ..., "points": 23,
               "max_rel_err_ge_1mb": 0.07 | null, "source": "<id>",
               "segments": [{"min_bytes": 8, "max_bytes": 524288, "alpha_s": ...,
                             "busbw_gbps": ...}, ...],
               "segments_max_rel_err_ge_1mb": 0.05 | null}],
     "published": [{"collective": ..., "group_size": ..., "level": ..., "busbw_gbps": ...,
                    "source": "..."}]}

  Time model (nccl-tests' bus bandwidth, see :mod:`autoplan.profile.fit`):
  ``t(bytes, n) = alpha + bytes · factor(collective, n) / busbw``. GB/s is 1e9 bytes/s.
  A fit with ``group_size: null`` pools every group size of its (collective, level).
  ``segments`` (optional, in increasing size order) refine the line piecewise: a message
  uses the last segment whose ``min_bytes`` it reaches (the first one below them all).

Writers merge under a file lock and replace the file atomically
(:func:`autoplan.profile.files.locked_update`): two processes adding entries to one file
both land, and a reader never sees half a file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from autoplan.errors import AutoplanError
from autoplan.graph import TensorMeta
from autoplan.profile.fit import (bus_factor, fit_alpha_beta, fit_segments, max_relative_error,
                                  segmented_error)
from autoplan.profile.files import (PROFILE_VERSION, Checker, ProfileError, device_slug,
                                    locked_update, measured_provenance, read_json, source_id)

__all__ = ["OpEntry", "OpProfile", "LinkPoint", "LinkSegment", "LinkFit", "LinkProfile",
           "ProfileError", "add_op_entries", "update_link_profile", "signature_key",
           "measured_provenance", "source_id", "device_slug", "COLLECTIVES", "LEVELS"]

OP_FORMAT = "autoplan.op_profile"
LINK_FORMAT = "autoplan.link_profile"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
LEVELS = ("intra", "inter")


def _tensor_dict(t: TensorMeta) -> dict[str, Any]:
    return {"dtype": t.dtype, "shape": list(t.shape)}


def tensor_key(t: TensorMeta) -> str:
    return f"{t.dtype}[{','.join(map(str, t.shape))}]"


# ---- op profiles ---------------------------------------------------------------------------

@dataclass(frozen=True)
class OpEntry:
    """Measured time of one op signature: median seconds over ``repeats`` repetitions.

    ``flops`` (torch.utils.flop_counter) and ``bytes`` (inputs + outputs) are the work
    measures :class:`autoplan.profile.lookup.OpTimeTable` interpolates in.
    """

    op: str
    dtype: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    fwd_s: float
    bwd_s: float | None
    repeats: int
    flops: float
    bytes: int
    source: str
    timed_as: str | None = None     # the portable op timed where the device lacks this kernel

    @property
    def key(self) -> str:
        return signature_key(self.op, self.inputs, self.outputs)

    def to_dict(self) -> dict[str, Any]:
        d = {"op": self.op, "dtype": self.dtype,
             "inputs": [_tensor_dict(t) for t in self.inputs],
             "outputs": [_tensor_dict(t) for t in self.outputs],
             "fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "repeats": self.repeats,
             "flops": self.flops, "bytes": self.bytes, "source": self.source}
        if self.timed_as is not None:
            d["timed_as"] = self.timed_as
        return d


def signature_key(op: str, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> str:
    """``op(in0, in1, ...)->(out0, ...)`` with tensors as ``dtype[d0,d1,...]``."""
    return (f"{op}({', '.join(tensor_key(t) for t in inputs)})"
            f"->({', '.join(tensor_key(t) for t in outputs)})")


@dataclass
class OpProfile:
    device: str
    entries: dict[str, OpEntry] = field(default_factory=dict)
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"format": OP_FORMAT, "version": PROFILE_VERSION, "device": self.device,
                "sources": self.sources,
                "entries": {k: self.entries[k].to_dict() for k in sorted(self.entries)}}

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> "OpProfile":
        c = Checker(source)
        d = c.header(d, OP_FORMAT)
        c.unknown(d, {"format", "version", "device", "sources", "entries"}, "")
        device = c.string(d, "device", "")
        sources = c.sources(d)
        entries: dict[str, OpEntry] = {}
        for key, e in c.obj(d.get("entries", {}), "entries").items():
            where = f"entries[{key!r}]"
            c.obj(e, where)
            c.unknown(e, {"op", "dtype", "inputs", "outputs", "fwd_s", "bwd_s", "repeats",
                          "flops", "bytes", "source", "timed_as"}, where)
            timed_as = e.get("timed_as")
            if timed_as is not None and not isinstance(timed_as, str):
                raise c.fail(f"{where}.timed_as", f"must be an op name, got {timed_as!r}")
            entry = OpEntry(
                op=c.string(e, "op", where), dtype=c.string(e, "dtype", where),
                inputs=tuple(c.tensor(t, f"{where}.inputs[{i}]") for i, t in
                             enumerate(c.lst(c.key(e, "inputs", where), f"{where}.inputs"))),
                outputs=tuple(c.tensor(t, f"{where}.outputs[{i}]") for i, t in
                              enumerate(c.lst(c.key(e, "outputs", where), f"{where}.outputs"))),
                fwd_s=c.number(e, "fwd_s", where),
                bwd_s=c.number(e, "bwd_s", where, optional=True),
                repeats=c.integer(e, "repeats", where, minimum=1),
                flops=c.number(e, "flops", where), bytes=c.integer(e, "bytes", where),
                source=c.source_ref(e, where, sources), timed_as=timed_as)
            if entry.key != key:
                raise c.fail(where, f"key does not match the entry's signature {entry.key!r}")
            entries[key] = entry
        return cls(device=device, entries=entries, sources=sources)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OpProfile":
        return cls.from_dict(read_json(path), source=str(path))

    def merge(self, other: "OpProfile") -> None:
        """Add ``other``'s entries (and their sources); on equal keys ``other`` wins."""
        self.entries.update(other.entries)
        for entry in other.entries.values():
            self.sources[entry.source] = other.sources[entry.source]
        self._drop_unused_sources()

    def _drop_unused_sources(self) -> None:
        used = {e.source for e in self.entries.values()}
        self.sources = {k: v for k, v in self.sources.items() if k in used}


def add_op_entries(path: str | os.PathLike, device: str, entries: list[OpEntry],
                   sources: dict[str, dict[str, Any]]) -> OpProfile:
    """Merge ``entries`` into the op profile at ``path`` (created if missing), atomically
    and under the file lock. Returns the profile as written."""
    def merge(current: dict | None) -> dict:
        prof = (OpProfile.from_dict(current, source=str(path)) if current is not None
                else OpProfile(device=device))
        if prof.device != device:
            raise ProfileError(f"holds device {prof.device!r}, not {device!r}",
                               source=str(path), field="device")
        prof.merge(OpProfile(device=device, entries={e.key: e for e in entries},
                             sources=dict(sources)))
        return prof.to_dict()

    return OpProfile.from_dict(locked_update(path, merge), source=str(path))


# ---- link profiles -------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkPoint:
    """One nccl-tests style measurement; ``bytes`` is the full buffer (nccl-tests' size).

    ``time_s`` is the statistic the run chose (its source's ``statistic``: the median of the
    repetitions, or their minimum on a shared machine); bandwidths derive from it. The
    median and minimum are kept as well when measured."""

    collective: str
    group_size: int
    level: str
    bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    source: str
    time_median_s: float | None = None
    time_min_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class LinkSegment:
    """The alpha-beta form on messages of ``min_bytes`` and more (up to the next segment)."""

    min_bytes: int
    max_bytes: int                  # the largest size measured in this segment
    alpha_s: float
    busbw_gbps: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LinkFit:
    """``t = alpha_s + bytes · factor(collective, n) / (busbw_gbps · 1e9)``, optionally
    refined by ``segments`` (piecewise over message sizes, :func:`autoplan.profile.fit.
    fit_segments`); ``max_rel_err_ge_1mb`` is the single line's error on its own points of
    >= 1 MB, ``segments_max_rel_err_ge_1mb`` the piecewise model's."""

    collective: str
    level: str
    group_size: int | None          # None: pooled over the group sizes measured
    alpha_s: float
    busbw_gbps: float
    points: int                     # measurements it was fitted to (0 for published)
    max_rel_err_ge_1mb: float | None
    source: str
    segments: tuple[LinkSegment, ...] = ()
    segments_max_rel_err_ge_1mb: float | None = None

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per bus byte: 1 / busbw."""
        return 1.0 / (self.busbw_gbps * 1e9)

    def line_for(self, nbytes: float, *, segmented: bool = True) -> tuple[float, float]:
        """(alpha_s, busbw_gbps) for a message of ``nbytes``: its segment's, else the line's."""
        if not (segmented and self.segments):
            return self.alpha_s, self.busbw_gbps
        chosen = self.segments[0]
        for seg in self.segments:
            if nbytes >= seg.min_bytes:
                chosen = seg
        return chosen.alpha_s, chosen.busbw_gbps

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["segments"] = [seg.to_dict() for seg in self.segments]
        return d


@dataclass
class LinkProfile:
    cluster: str
    backend: str
    levels_present: list[str]
    note: str = ""
    points: list[LinkPoint] = field(default_factory=list)
    fits: list[LinkFit] = field(default_factory=list)
    published: list[dict[str, Any]] = field(default_factory=list)
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)

    # ---- queries -----------------------------------------------------------------------
    def fit_for(self, collective: str, level: str, group_size: int | None = None) -> LinkFit:
        """The fit for ``group_size`` if one was made for it, else the pooled one."""
        pooled = None
        for f in self.fits:
            if f.collective == collective and f.level == level:
                if f.group_size == group_size and group_size is not None:
                    return f
                if f.group_size is None:
                    pooled = f
        if pooled is None:
            have = sorted({(f.collective, f.level) for f in self.fits})
            raise ProfileError(f"no fit for ({collective}, {level}); the profile has {have}",
                               source=self.cluster, field="fits")
        return pooled

    def predict(self, collective: str, level: str, nbytes: float, group_size: int, *,
                segmented: bool = True) -> float:
        """Seconds for one ``collective`` of ``nbytes`` (nccl-tests size) over ``group_size``,
        by the fit for that group size (else the pooled one), piecewise where it has
        segments unless ``segmented=False``."""
        alpha, busbw = self.fit_for(collective, level, group_size).line_for(
            nbytes, segmented=segmented)
        return alpha + nbytes * bus_factor(collective, group_size) / (busbw * 1e9)

    def fitted_table(self, group_size: int | None = None, nbytes: float | None = None
                     ) -> dict[tuple[str, str], tuple[float, float]]:
        """Alpha-beta per (collective, level), as the cost model's
        ``CommModel(cluster, fitted=...)`` takes it:
        ``{(collective, level): (alpha_s, beta_s_per_byte)}``.

        By default the pooled single line of each (collective, level). With ``group_size``
        the fit for that group size where there is one; with ``nbytes`` the segment of the
        piecewise fit that covers messages of that size (e.g. the gradient bucket)."""
        table = {}
        for collective, level in sorted({(f.collective, f.level) for f in self.fits}):
            f = self.fit_for(collective, level, group_size)
            alpha, busbw = f.line_for(nbytes if nbytes is not None else 0.0,
                                      segmented=nbytes is not None)
            table[(collective, level)] = (alpha, 1.0 / (busbw * 1e9))
        return table

    # ---- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        points = sorted(self.points, key=lambda p: (p.collective, p.level, p.group_size, p.bytes))
        fits = sorted(self.fits, key=lambda f: (f.collective, f.level, f.group_size or 0))
        return {"format": LINK_FORMAT, "version": PROFILE_VERSION, "cluster": self.cluster,
                "backend": self.backend, "levels_present": list(self.levels_present),
                "note": self.note, "sources": self.sources,
                "points": [p.to_dict() for p in points], "fits": [f.to_dict() for f in fits],
                "published": list(self.published)}

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> "LinkProfile":
        c = Checker(source)
        d = c.header(d, LINK_FORMAT)
        c.unknown(d, {"format", "version", "cluster", "backend", "levels_present", "note",
                      "sources", "points", "fits", "published"}, "")
        sources = c.sources(d)
        levels = c.lst(c.key(d, "levels_present", ""), "levels_present")
        for i, lv in enumerate(levels):
            if lv not in LEVELS:
                raise c.fail(f"levels_present[{i}]", f"must be one of {list(LEVELS)}, got {lv!r}")
        points = []
        for i, p in enumerate(c.lst(d.get("points", []), "points")):
            w = f"points[{i}]"
            c.obj(p, w)
            c.unknown(p, set(LinkPoint.__dataclass_fields__), w)
            points.append(LinkPoint(
                collective=c.string(p, "collective", w, COLLECTIVES),
                group_size=c.integer(p, "group_size", w, minimum=2),
                level=c.string(p, "level", w, LEVELS), bytes=c.integer(p, "bytes", w, minimum=1),
                time_s=c.number(p, "time_s", w, positive=True),
                algbw_gbps=c.number(p, "algbw_gbps", w), busbw_gbps=c.number(p, "busbw_gbps", w),
                source=c.source_ref(p, w, sources),
                time_median_s=c.number(p, "time_median_s", w, optional=True),
                time_min_s=c.number(p, "time_min_s", w, optional=True)))
        fits = []
        for i, f in enumerate(c.lst(d.get("fits", []), "fits")):
            w = f"fits[{i}]"
            c.obj(f, w)
            c.unknown(f, set(LinkFit.__dataclass_fields__), w)
            segments = []
            for j, sg in enumerate(c.lst(f.get("segments", []), f"{w}.segments")):
                ws = f"{w}.segments[{j}]"
                c.obj(sg, ws)
                c.unknown(sg, set(LinkSegment.__dataclass_fields__), ws)
                segments.append(LinkSegment(
                    min_bytes=c.integer(sg, "min_bytes", ws),
                    max_bytes=c.integer(sg, "max_bytes", ws),
                    alpha_s=c.number(sg, "alpha_s", ws),
                    busbw_gbps=c.number(sg, "busbw_gbps", ws, positive=True)))
                if j and segments[j].min_bytes <= segments[j - 1].max_bytes:
                    raise c.fail(f"{ws}.min_bytes", "segments must be in increasing, "
                                                    "non-overlapping size order")
            fits.append(LinkFit(
                collective=c.string(f, "collective", w, COLLECTIVES),
                level=c.string(f, "level", w, LEVELS),
                group_size=c.integer(f, "group_size", w, optional=True, minimum=2),
                alpha_s=c.number(f, "alpha_s", w),
                busbw_gbps=c.number(f, "busbw_gbps", w, positive=True),
                points=c.integer(f, "points", w),
                max_rel_err_ge_1mb=c.number(f, "max_rel_err_ge_1mb", w, optional=True),
                source=c.source_ref(f, w, sources), segments=tuple(segments),
                segments_max_rel_err_ge_1mb=c.number(f, "segments_max_rel_err_ge_1mb", w,
                                                     optional=True)))
        published = c.lst(d.get("published", []), "published")
        for i, p in enumerate(published):
            w = f"published[{i}]"
            c.obj(p, w)
            c.unknown(p, {"collective", "group_size", "level", "busbw_gbps", "source"}, w)
            c.string(p, "collective", w, COLLECTIVES)
            c.integer(p, "group_size", w, optional=True, minimum=2)
            c.string(p, "level", w, LEVELS)
            c.number(p, "busbw_gbps", w, positive=True)
            c.string(p, "source", w)
        note = d.get("note", "")
        if not isinstance(note, str):
            raise c.fail("note", f"must be a string, got {type(note).__name__}")
        return cls(cluster=c.string(d, "cluster", ""), backend=c.string(d, "backend", ""),
                   levels_present=list(levels), note=note, points=points, fits=fits,
                   published=published, sources=sources)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LinkProfile":
        return cls.from_dict(read_json(path), source=str(path))


def update_link_profile(path: str | os.PathLike,
                        change: Callable[[LinkProfile | None], LinkProfile]) -> LinkProfile:
    """Read the link profile at ``path`` (None if missing), apply ``change``, and write the
    result atomically under the file lock."""
    def apply(current: dict | None) -> dict:
        prof = LinkProfile.from_dict(current, source=str(path)) if current is not None else None
        return change(prof).to_dict()

    return LinkProfile.from_dict(locked_update(path, apply), source=str(path))


def fit_link_points(points, source: str) -> tuple[list, list[str]]:
    """Fits for measured :class:`LinkPoint` s: one per
    (collective, level, group size) and one pooled per (collective, level) — the pooled fit
    is what ``LinkProfile.fitted_table`` hands the cost model — each with its piecewise
    refinement (:func:`fit_segments`) and the max relative errors of both on its own points
    of >= 1 MB. Returns (fits, problems): a set of points that no bandwidth fits (time flat
    in size: too few or too small messages) is reported, not fitted."""
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
        segs = fit_segments(collective, b, g, t)
        fits.append(LinkFit(
            collective=collective, level=level, group_size=n, alpha_s=ab.alpha_s,
            busbw_gbps=ab.busbw_gbps, points=len(pts),
            max_rel_err_ge_1mb=max_relative_error(ab, collective, b, g, t), source=source,
            segments=tuple(LinkSegment(s.min_bytes, s.max_bytes, s.fit.alpha_s,
                                       s.fit.busbw_gbps) for s in segs) if len(segs) > 1 else (),
            segments_max_rel_err_ge_1mb=segmented_error(segs, collective, b, g, t)
            if len(segs) > 1 else None))
    return fits, problems
