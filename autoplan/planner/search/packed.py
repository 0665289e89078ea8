"""One anchor's candidate strategies packed into arrays, priced at any micro-batch at once.

:meth:`~autoplan.planner.search.costs.CostModel.kind_costs` prices every candidate
strategy of every anchor of a layer kind on a mesh at a micro-batch B. What does not depend
on B (:class:`~autoplan.planner.search.costs._Candidate`: the ops each candidate runs and
how each is split, its resharding collectives, its saved tensors, its parameters) is built
once per kind and mesh shape; this module flattens those records into arrays -- one entry
per (candidate, op), (candidate, collective), (candidate, saved tensor) -- so that a new B
costs one ``op_time`` per *distinct* (op, split) and one collective per distinct
(collective, axis, bytes), then a weighted ``np.bincount`` per figure, instead of a Python
loop over every op of every candidate (issue #18: 48 meshes x 12 micro-batch counts of a
GPT-39B search).

With scale = B / b0 (b0 the traced micro-batch), per candidate c (the formulas of
:mod:`autoplan.planner.search.costs`)::

    fwd_c, bwd_c = sum over ops o of c  op_time(o, tp_o, scale / batch_split_o if batchy_o
                                                 else 1)
    comm_c[d]    = sum over moves of c in direction d  coll(collective, bytes x (scale if
                                                         scaled) / divisor, axis)
    act_c        = sum over saved tensors of c  bytes x (scale if batchy) / shard
    orf_c, okept_c = the fwd_c of the ops op-level recomputation runs again, the act_c of
                   the outputs it keeps (:mod:`autoplan.cost.recompute`)

and a candidate is valid at B when every batch-scaled dim it shards, dim x scale, is a whole
number divisible by its shard count. ``np.bincount`` adds its weights in input order, and
the entries are laid out candidate by candidate in the records' order, so every sum is the
same floating-point sum, term for term, as the loop over the records.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PackedAnchor:
    """The candidates ``rows`` ((strategy, record) pairs) of one anchor as flat arrays."""

    def __init__(self, rows: list, core: frozenset[str], gemms: frozenset[str],
                 again: frozenset[str] = frozenset()):
        self.ks = np.array([k for k, _ in rows], dtype=np.int64)
        self.records = [rec for _, rec in rows]
        n = len(rows)
        self.n = n
        chk = [(r, dim, div) for r, rec in enumerate(self.records)
               for dim, _, div in rec.checks]
        self.chk_row = np.array([c[0] for c in chk], dtype=np.int64)
        self.chk_dim = np.array([c[1] for c in chk], dtype=float)
        self.chk_div = np.array([c[2] for c in chk], dtype=np.int64)
        # ops: distinct (name, tp, batch split, batchy) configurations
        cfg_of: dict[tuple, int] = {}
        op_row, op_cfg = [], []
        for r, rec in enumerate(self.records):
            for op in rec.ops:
                op_row.append(r)
                op_cfg.append(cfg_of.setdefault(op, len(cfg_of)))
        self.cfgs = list(cfg_of)
        self.op_row = np.array(op_row, dtype=np.int64)
        self.op_cfg = np.array(op_cfg, dtype=np.int64)
        self.cfg_core = np.array([c[0] in core for c in self.cfgs], dtype=bool)
        self.cfg_gemm = np.array([c[0] in gemms for c in self.cfgs], dtype=bool)
        self.cfg_again = np.array([c[0] in again for c in self.cfgs], dtype=bool)
        # moves: distinct (collective, axis, bytes, scaled, divisor)
        mv_of: dict[tuple, int] = {}
        mv_row, mv_cfg, mv_fwd = [], [], []
        for r, rec in enumerate(self.records):
            for d, c, ax, nb, sc, div in rec.moves:
                mv_row.append(r)
                mv_cfg.append(mv_of.setdefault((c, ax, nb, sc, div), len(mv_of)))
                mv_fwd.append(d == "fwd")
        self.moves = list(mv_of)
        self.mv_row = np.array(mv_row, dtype=np.int64)
        self.mv_cfg = np.array(mv_cfg, dtype=np.int64)
        self.mv_fwd = np.array(mv_fwd, dtype=bool)
        sv = [(r, nb, batchy, shard, attn) for r, rec in enumerate(self.records)
              for nb, batchy, shard, attn in rec.saved]
        self.sv_row = np.array([s[0] for s in sv], dtype=np.int64)
        self.sv_nb = np.array([s[1] for s in sv], dtype=float)
        self.sv_batchy = np.array([s[2] for s in sv], dtype=bool)
        self.sv_shard = np.array([s[3] for s in sv], dtype=float)
        self.sv_attn = np.array([s[4] for s in sv], dtype=bool)
        ok = [(r, nb, shard) for r, rec in enumerate(self.records)
              for nb, shard in rec.op_saved]
        self.ok_row = np.array([o[0] for o in ok], dtype=np.int64)
        self.ok_nb = np.array([o[1] for o in ok], dtype=float)      # each grows with B
        self.ok_shard = np.array([o[2] for o in ok], dtype=float)
        self.pvec = np.array([rec.pvec for rec in self.records], dtype=float).reshape(n, -1)
        self.gbytes = np.array([rec.gbytes for rec in self.records], dtype=float)
        self.tp_matmuls = np.array([rec.tp_matmuls for rec in self.records], dtype=int)
        # output / input specs: per key, (rows having it, spec per such row)
        self.o_specs = _by_key([rec.o_specs for rec in self.records])
        self.i_specs = _by_key([rec.i_specs for rec in self.records])
        self._kept: dict[bytes, Kept] = {}

    def kept(self, ai: int, keep: np.ndarray) -> "Kept":
        """The figures of rows ``keep`` that do not depend on the micro-batch (anchor
        ``ai``'s strategies, parameters, specs), kept per distinct ``keep``: a few micro-batch
        counts leave different rows valid."""
        key = keep.tobytes()
        hit = self._kept.get(key)
        if hit is None:
            hit = self._kept[key] = Kept(self, ai, keep)
        return hit

    def valid(self, scale: float) -> np.ndarray:
        """Indices of the rows valid at micro-batch scale ``scale`` (module docstring)."""
        x = self.chk_dim * scale
        whole = x == np.trunc(x)
        ok = whole & (np.where(whole, x, 0).astype(np.int64) % self.chk_div == 0)
        bad = np.bincount(self.chk_row[~ok], minlength=self.n) > 0
        return np.flatnonzero(~bad)

    def _sum(self, rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return np.bincount(rows, weights, minlength=self.n) if len(rows) else \
            np.zeros(self.n)

    def price(self, cm, mesh, scale: float) -> dict:
        """Every row's figures at micro-batch scale ``scale`` on ``mesh`` (full length n)."""
        tf = np.empty(len(self.cfgs))
        tb = np.empty(len(self.cfgs))
        for i, (name, tp, batch_split, batchy) in enumerate(self.cfgs):
            tf[i], tb[i] = cm.op_time(name, tp, scale / batch_split if batchy else 1.0)
        ef, eb = tf[self.op_cfg], tb[self.op_cfg]
        core, gemm = self.cfg_core[self.op_cfg], self.cfg_gemm[self.op_cfg]
        again = self.cfg_again[self.op_cfg]
        mt = np.array([cm.coll(c, nb * (scale if sc else 1.0) / div, mesh.group((ax,)))
                       for c, ax, nb, sc, div in self.moves], dtype=float)[self.mv_cfg] \
            if self.moves else np.zeros(0)
        sv = self.sv_nb * np.where(self.sv_batchy, scale, 1.0) / self.sv_shard
        ok = self.ok_nb * scale / self.ok_shard
        return {"fwd": self._sum(self.op_row, ef), "bwd": self._sum(self.op_row, eb),
                "cof": self._sum(self.op_row, np.where(core, ef, 0.0)),
                "gf": self._sum(self.op_row, np.where(gemm, ef, 0.0)),
                "gb": self._sum(self.op_row, np.where(gemm, eb, 0.0)),
                "cf": self._sum(self.mv_row, np.where(self.mv_fwd, mt, 0.0)),
                "cb": self._sum(self.mv_row, np.where(self.mv_fwd, 0.0, mt)),
                "act": self._sum(self.sv_row, sv),
                "attn": self._sum(self.sv_row, np.where(self.sv_attn, sv, 0.0)),
                "orf": self._sum(self.op_row, np.where(again, ef, 0.0)),
                "okept": self._sum(self.ok_row, ok)}


class Kept:
    """The rows ``keep`` of a :class:`PackedAnchor` (anchor ``ai`` of its kind): their
    strategies, local parameters per sync bucket, gathered bytes, TP matmuls, output specs
    and ``KindCosts.in_info`` entries -- what ``CostModel.kind_costs`` takes of them at
    every micro-batch that leaves these rows valid."""

    def __init__(self, pk: PackedAnchor, ai: int, keep: np.ndarray):
        n = len(keep)
        self.cand = pk.ks[keep]
        self.psi = pk.pvec[keep].reshape(n, -1)
        self.gathered = pk.gbytes[keep]
        self.tp_matmuls = pk.tp_matmuls[keep]
        everyone = n == pk.n
        self.out_specs = {key: vals if everyone else _rows_of(rows, vals, keep)
                          for key, (rows, vals) in pk.o_specs.items()}
        self.in_info = {}
        for key, (rows, vals) in pk.i_specs.items():
            pairs = vals if everyone else _rows_of(rows, vals, keep)
            self.in_info[key] = (ai, [v[0] for v in pairs], [v[1] for v in pairs])


def _rows_of(rows: np.ndarray, vals: list, keep: np.ndarray) -> list:
    """``vals`` (one per row in ``rows``) of the rows in ``keep``, in order."""
    kept = set(keep.tolist())
    return [v for r, v in zip(rows.tolist(), vals) if r in kept]


def _by_key(dicts: list[dict]) -> dict:
    out: dict = {}
    for r, d in enumerate(dicts):
        for key, val in d.items():
            rows, vals = out.setdefault(key, ([], []))
            rows.append(r)
            vals.append(val)
    return {k: (np.array(rows, dtype=np.int64), vals) for k, (rows, vals) in out.items()}


class Internal(Sequence):
    """The resharding collectives of the kept rows at one scale, built on first use:
    ``[j]`` -> [(direction, collective, axis, bytes)] of kept candidate j."""

    def __init__(self, packed: PackedAnchor, keep: np.ndarray, scale: float):
        self._packed, self._keep, self._scale = packed, keep, scale
        self._done: dict[int, list] = {}

    def __len__(self) -> int:
        return len(self._keep)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        hit = self._done.get(j)
        if hit is None:
            rec = self._packed.records[int(self._keep[j])]
            s = self._scale
            hit = self._done[j] = [(d, c, ax, nb * (s if sc else 1.0) / div)
                                   for d, c, ax, nb, sc, div in rec.moves]
        return hit
