"""Per-layer prices of a layer kind's candidate layouts on one logical mesh at one
micro-batch: the rows the stage tables (:mod:`autoplan.planner.search.tables`) sum.

A *layout* is one strategy per op group of a kind (:mod:`autoplan.planner.search.library`).
:func:`kind_table` prices every library layout valid on the mesh with
:class:`~autoplan.planner.search.evaluate.Evaluator`'s pieces, per layer: compute forward
and backward (the anchors' :class:`~autoplan.planner.search.costs.KindCosts`), the layer's
resharding collectives (bucketed as the evaluator buckets them), the activations it keeps
(its own and the tensors it reads from the previous layer, as its consumers place them),
the input a recomputed layer keeps, its local parameters per sync bucket, the bytes ZeRO-3
gathers, the attention core's forward time and matrices (selective recomputation), and
what op-level recomputation runs again (forward compute and collectives) and keeps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from autoplan.planner.search.costs import BUCKETS, CORE_ACT, CORE_FWD, OP_ACT, OP_FWD
from autoplan.planner.search.evaluate import Evaluator
from autoplan.planner.search.mesh import LogicalMesh


@dataclass
class KindTable:
    """Per valid layout of one kind on one mesh at one micro-batch (per layer)."""

    layouts: list[tuple[int, ...]]     # KindCosts indices per anchor
    f: np.ndarray                      # compute forward (s)
    b: np.ndarray                      # compute backward
    cf: np.ndarray                     # layer communication forward
    cb: np.ndarray
    act: np.ndarray                    # activations kept (bytes), input included
    kept: np.ndarray                   # kept when recomputed (the input only)
    psi: np.ndarray                    # (L, 4) local parameters per sync bucket
    gathered: np.ndarray               # parameter bytes, gathered (ZeRO-3)
    row_of: dict[tuple[int, ...], int] = None     # library layout -> row
    sf: np.ndarray = None              # attention core's forward (selective recomputation)
    sact: np.ndarray = None            # its attention matrices (bytes)
    of: np.ndarray = None              # op-level recomputation: forward compute run again,
    oc: np.ndarray = None              # forward collectives run again,
    oact: np.ndarray = None            # outputs kept (bytes; the input is ``kept``)

    @functools.cached_property
    def columns(self) -> np.ndarray:
        """(layouts, COLUMNS + 4): f, b, cf, cb, act, kept, gathered, sf, sact, of, oc,
        oact, psi (4) per layout (what :func:`layer_arrays` gathers per layer)."""
        return np.column_stack([self.f, self.b, self.cf, self.cb, self.act, self.kept,
                                self.gathered, self.sf, self.sact, self.of, self.oc,
                                self.oact, self.psi])


#: the per-layout figures of :attr:`KindTable.columns` before the four ``psi`` buckets
COLUMNS = 12


def kind_table(ev: Evaluator, kind: str, mesh: LogicalMesh, micro_batch: int,
               layouts: list[tuple[int, ...]]) -> KindTable | None:
    """Price the library ``layouts`` (strategy indices per anchor) valid on ``mesh``.

    Every figure of every layout at once, as arrays over the layouts: a sum over anchors
    (or tensors) adds its terms in anchor (tensor) order, so each equals, bit for bit, the
    per-layout loop of a Python ``sum`` (checked in tests/test_search_fast_paths.py); the
    parameters per sync bucket, which do not depend on the micro-batch, are kept per
    (kind, mesh, strategies) (:func:`_psi`)."""
    kc = ev.kind_costs(kind, mesh, micro_batch)
    pos = [{int(k): i for i, k in enumerate(c)} for c in kc.cand]
    valid = []
    row_of: dict[tuple[int, ...], int] = {}
    for lay in layouts:
        idx = tuple(pos[ai].get(k) for ai, k in enumerate(lay))
        if None in idx:
            continue
        if idx not in valid:
            valid.append(idx)
        row_of[tuple(lay)] = valid.index(idx)
    if not valid:
        return None
    ch = np.array(valid, dtype=np.int64).reshape(len(valid), len(kc.anchors))

    def total(per_anchor, col=None) -> np.ndarray:
        out = np.zeros(len(valid))          # a kind without anchors (no op to place) costs 0
        for ai, values in enumerate(per_anchor):
            x = values[ch[:, ai]] if col is None else values[ch[:, ai], col]
            out = out + x
        return out

    cf = np.empty(len(valid))
    cb = np.empty(len(valid))
    oc = np.empty(len(valid))
    o_rs = np.empty(len(valid))
    psi = np.empty((len(valid), len(BUCKETS)))
    for r, c in enumerate(valid):
        fb, bb, moved = ev.layer_buckets(kind, mesh, micro_batch, c)
        cf[r], cb[r] = ev._time(fb, mesh), ev._time(bb, mesh)
        oc[r], o_rs[r] = ev.op_recompute(fb, mesh, total=cf[r])
        psi[r] = _psi(ev, kc, c, moved)
    act = total(kc.act) + _imported(ev, kind, mesh, micro_batch, ch)
    return KindTable(valid, total(kc.fwd), total(kc.bwd), cf, cb, act,
                     _kept(ev, kind, mesh, micro_batch, ch), psi, total(kc.gathered),
                     row_of, total(kc.extra, CORE_FWD), total(kc.extra, CORE_ACT),
                     total(kc.extra, OP_FWD), oc, total(kc.extra, OP_ACT) + o_rs)


def _psi(ev: Evaluator, kc, choice: tuple[int, ...], moved: dict) -> np.ndarray:
    """Local parameters per sync bucket of ``choice`` (a Partial gradient deferred to a
    sink, ``moved``, adds its axes to the anchor's buckets): the same at every micro-batch,
    kept per (kind, mesh, strategies)."""
    strategies = tuple(int(kc.cand[ai][j]) for ai, j in enumerate(choice))
    key = (kc.kg.kind, kc.mesh, strategies)
    hit = ev._psi.get(key)
    if hit is None:
        hit = np.zeros(len(BUCKETS))
        for ai, j in enumerate(choice):
            p = kc.psi[ai][j]
            extra = moved.get(ai, ())
            for bi, axes in enumerate(BUCKETS):
                hit[BUCKETS.index(tuple(sorted(set(axes) | set(extra))))] += p[bi]
        ev._psi[key] = hit
    return hit


def _shard(mesh: LogicalMesh, specs: list) -> np.ndarray:
    """Per candidate placement: the devices its Shard placements split a tensor over."""
    return np.array([math.prod(mesh.shape[a] for a in range(2)
                               if spec is not None and spec[a].startswith("S"))
                     for spec in specs], dtype=np.int64)


def _imported(ev: Evaluator, kind: str, mesh, micro_batch: int, ch: np.ndarray
              ) -> np.ndarray:
    """Per layout (rows of ``ch``): bytes a layer of ``kind`` keeps of the tensors it reads
    from the previous layer, sharded as its consumers place them."""
    out = np.zeros(len(ch))
    l = ev.ms.kinds[kind].layer
    if l == 0:
        return out
    prev = ev.ms.layer_kind[l - 1]
    kc_a = ev.kind_costs(prev, mesh, micro_batch)
    kc_b = ev.kind_costs(kind, mesh, micro_batch)
    for v, nbytes, specs in ev.ms.imported(prev, kind, kc_a, kc_b):
        out = out + nbytes / _shard(mesh, specs)[ch[:, v]]
    return out


def _kept(ev: Evaluator, kind: str, mesh, micro_batch: int, ch: np.ndarray) -> np.ndarray:
    """Per layout (rows of ``ch``): input bytes kept by a recomputed layer of ``kind``, as
    its consumers place them (:meth:`Evaluator._kept_input` of a one-layer stage: per
    tensor the least of its reads, summed in order of first read)."""
    from autoplan.planner.search.compose import transition_edges

    ms = ev.ms
    l = ms.kinds[kind].layer
    whole = np.full(len(ch), ev.graph.layers[l].stats.input_bytes * micro_batch / ev.b0)
    if l == 0:
        return whole
    prev = ms.layer_kind[l - 1]
    kc_a = ev.kind_costs(prev, mesh, micro_batch)
    kc_b = ev.kind_costs(kind, mesh, micro_batch)
    seen: dict[tuple[int, int], np.ndarray] = {}
    for e in transition_edges(ms, (prev, kind), kc_a, kc_b):
        x = e.nbytes / _shard(mesh, kc_b.in_info[(e.m, e.q)][1])[ch[:, e.v]]
        seen[(e.p, e.o)] = np.minimum(seen[(e.p, e.o)], x) if (e.p, e.o) in seen else x
    if not seen:
        return whole
    out = None
    for x in seen.values():
        out = x if out is None else out + x
    return out
