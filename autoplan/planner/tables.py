"""Stage latency tables for the inter-op DP: every unit range on every submesh at once.

For one logical mesh and micro-batch, each layer kind has a few candidate *layouts* (one
placement per op group, :mod:`autoplan.planner.library`). :func:`kind_table` prices each
layout per layer with :class:`~autoplan.planner.evaluate.Evaluator`'s pieces: compute,
layer communication (bucketed as the evaluator does), activations, parameters per sync
bucket. A stage's configuration is then a *combo* (lambda, ZeRO stage z, recomputation):
each kind takes the layout minimising

    score = t + (OVERLAP_COST sync + optimizer) / m + lambda (states_z + act)

(a Lagrangian split of the stage's memory budget over its kinds), and
:func:`range_table` sums the per-layer figures over every range of units with prefix sums::

    t(i, j)     = sum_l (t_l [+ t_fwd,l + c_fwd,l if recomputed]) + sum of transitions
                  + 2 send + u(i, j) / m
    u(i, j)     = _exposed(all-reduce(psi), bwd) [+ m _exposed(2 all-gather(psi), fwd+bwd)]
                  + optimizer(psi / D^{[z>=1]})
    mem(i,j,s)  = states_z(psi) + s act(i, j) + peak(i, j) [+ 2 gathered(i, j) if z = 3]

and keeps, for each stage position s (micro-batches in flight), the fastest combo that fits.
Everything here is arrays; the exact price of what the DP picks comes from the evaluator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autoplan.planner.costs import BUCKETS, REDUCE_BYTES
from autoplan.planner.estimate import OVERLAP_COST
from autoplan.planner.evaluate import Evaluator
from autoplan.planner.mesh import LogicalMesh

INF = math.inf


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


def _line(ev: Evaluator, collective: str, group) -> tuple[float, float]:
    """(alpha, seconds per byte) of ``collective`` on ``group`` (0, 0 for one rank)."""
    return ev.cm.line(collective, group)


def _coll_vec(line: tuple[float, float], nbytes: np.ndarray) -> np.ndarray:
    alpha, beta = line
    return np.where(nbytes > 0, alpha + beta * nbytes, 0.0)


def kind_table(ev: Evaluator, kind: str, mesh: LogicalMesh, micro_batch: int,
               layouts: list[tuple[int, ...]]) -> KindTable | None:
    """Price the library ``layouts`` (strategy indices per anchor) valid on ``mesh``."""
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
    rows = []
    for ch in valid:
        f = sum(kc.fwd[ai][j] for ai, j in enumerate(ch))
        b = sum(kc.bwd[ai][j] for ai, j in enumerate(ch))
        fb, bb, moved = ev.layer_buckets(kind, mesh, micro_batch, ch)
        psi = np.zeros(len(BUCKETS))
        for ai, j in enumerate(ch):
            p = kc.psi[ai][j]
            extra = moved.get(ai, ())
            for bi, axes in enumerate(BUCKETS):
                psi[BUCKETS.index(tuple(sorted(set(axes) | set(extra))))] += p[bi]
        act = sum(kc.act[ai][j] for ai, j in enumerate(ch)) + _imported(ev, kind, mesh,
                                                                         micro_batch, ch)
        rows.append((f, b, ev._time(fb, mesh), ev._time(bb, mesh), act,
                     _kept(ev, kind, mesh, micro_batch, ch), psi,
                     sum(kc.gathered[ai][j] for ai, j in enumerate(ch))))
    arr = list(zip(*rows))
    return KindTable(valid, *(np.array(a, dtype=float) for a in arr[:6]),
                     np.array(arr[6]), np.array(arr[7], dtype=float), row_of)


def _imported(ev: Evaluator, kind: str, mesh, micro_batch: int, ch) -> float:
    l = ev.ms.kinds[kind].layer
    if l == 0:
        return 0.0
    prev = ev.ms.layer_kind[l - 1]
    kc_a = ev.kind_costs(prev, mesh, micro_batch)
    kc_b = ev.kind_costs(kind, mesh, micro_batch)
    out = 0.0
    for v, nbytes, specs in ev.ms.imported(prev, kind, kc_a, kc_b):
        spec = specs[ch[v]]
        out += nbytes / math.prod(mesh.shape[a] for a in range(2)
                                  if spec is not None and spec[a].startswith("S"))
    return out


def _kept(ev: Evaluator, kind: str, mesh, micro_batch: int, ch) -> float:
    """Input bytes kept by a recomputed layer of ``kind``, as its consumers place them."""
    from autoplan.planner.evaluate import StageChoice

    l = ev.ms.kinds[kind].layer
    st = StageChoice(l, l + 1, mesh, ((kind, ch),))
    return ev._kept_input(st, l, micro_batch)


@dataclass
class RangeTable:
    """Best stage latency per (position s, unit range) on one submesh, and what gave it."""

    time: np.ndarray                   # (S + 1, U, U + 1)
    combo: np.ndarray                  # (S + 1, U, U + 1) index into ``combos``
    mesh: np.ndarray                   # (S + 1, U, U + 1) index into ``meshes``
    combos: list[tuple[float, int, bool]]
    meshes: list[LogicalMesh]
    choice: dict[tuple[int, int], dict[str, int]]   # (mesh idx, combo idx) -> kind -> row


def pick_layouts(ev: Evaluator, kt: dict, mesh: LogicalMesh, m: int,
                 combos: list[tuple[float, int, bool]]) -> list[dict[str, int]]:
    """Per combo, per kind: the layout row minimising the combo's score (module docstring)."""
    ms = ev.ms
    groups = [mesh.group(axes) for axes in BUCKETS]
    dsize = np.array([g.size for g in groups], dtype=float)
    div = np.where(dsize > 1, dsize, 1.0)
    p_b, g_b, o_b = ev.cm.state_bytes
    opt_rate = ev.cm.compute.optimizer_time(1.0)
    fixed = {c: i for i, c in enumerate(combos) if isinstance(c[0], tuple)}
    lam = np.array([0.0 if isinstance(c[0], tuple) else c[0] for c in combos])[:, None]
    zs = np.array([c[1] for c in combos])
    cks = np.array([c[2] for c in combos])[:, None]
    finite = np.isfinite(lam)
    # bytes per parameter of each bucket at each combo's ZeRO stage: (C, 4)
    per = (p_b / np.where(zs[:, None] >= 3, div, 1.0) + g_b / np.where(zs[:, None] >= 2, div, 1.0)
           + o_b / np.where(zs[:, None] >= 1, div, 1.0))
    opt_div = np.where(zs[:, None] >= 1, div, 1.0)
    picks: list[dict[str, int]] = [{} for _ in combos]
    for k, t in kt.items():
        states = per @ t.psi.T                                        # (C, L)
        sync = sum(_coll_vec(_line(ev, "all_reduce", groups[bi]), t.psi[:, bi] * REDUCE_BYTES)
                   for bi in range(len(BUCKETS)))
        opt = opt_rate * ((1.0 / opt_div) @ t.psi.T)                  # (C, L)
        rec = cks & ms.is_block[ms.kinds[k].layer]
        tl = t.f + t.b + t.cf + t.cb + np.where(rec, t.f + t.cf, 0.0)
        mem = states + np.where(rec, t.kept, t.act)
        score = np.where(finite, tl + (OVERLAP_COST * sync + opt) / m +
                         np.where(finite, lam, 0.0) * mem, mem + 1e-9 * tl)
        best = np.argmin(score, axis=1)
        for c, row in enumerate(best):
            picks[c][k] = int(row)
    # "coherent" combos: every kind takes the layout one whole-model ILP solve gave it (the
    # solve priced the transitions between kinds, which per-kind scores leave out)
    for combo, c in fixed.items():
        layouts = dict(combo[0])
        rows = {k: kt[k].row_of.get(layouts.get(k)) for k in kt}
        picks[c] = rows if None not in rows.values() else None
    return picks


def range_table(ev: Evaluator, meshes: list[LogicalMesh], micro_batch: int, m: int,
                units: list[int], max_stages: int, tables: dict, arrays, *,
                combos: list[tuple[float, int, bool]], memory: float) -> RangeTable:
    """(module docstring) ``units``: layer index where each unit starts, plus the end;
    ``tables[(kind, mesh)]``: the :class:`KindTable` of each kind (None: no valid layout);
    ``arrays(mesh, kt, pick, checkpoint)``: cached :func:`layer_arrays`."""
    ms = ev.ms
    u_count = len(units) - 1
    s1 = max_stages + 1
    best_t = np.full((s1, u_count, u_count + 1), INF)
    best_c = np.full(best_t.shape, -1, dtype=np.int64)
    best_m = np.full(best_t.shape, -1, dtype=np.int64)
    choice: dict[tuple[int, int], dict[str, int]] = {}
    kinds = list(dict.fromkeys(ms.layer_kind))
    ui, uj = np.triu_indices(u_count + 1, k=1)          # every unit range [i, j)
    keep = ui < u_count
    ui, uj = ui[keep], uj[keep]
    starts, ends = np.array(units)[ui], np.array(units)[uj]
    for mi, mesh in enumerate(meshes):
        kt = {k: tables.get((k, mesh)) for k in kinds}
        if any(v is None for v in kt.values()):
            continue
        done: dict[tuple, bool] = {}
        picks = pick_layouts(ev, kt, mesh, m, combos)
        for ci, (lam, z, ck) in enumerate(combos):
            pick = picks[ci]
            if pick is None:                # a coherent layout not valid on this mesh
                continue
            choice[(mi, ci)] = pick
            key = (tuple(sorted(pick.items())), z, ck)
            if key in done:                 # another lambda picked the same layouts
                continue
            done[key] = True
            la = arrays(mesh, kt, pick, ck)
            rc = range_costs(ev, la, mesh, micro_batch, m, z, starts, ends)
            lat = rc.t + rc.send + rc.u / m
            mem = rc.states[None, :] + np.arange(s1)[:, None] * rc.act[None, :] \
                + rc.fixed[None, :]                                    # (S + 1, P)
            ok = mem <= memory
            cur = best_t[:, ui, uj]
            better = ok & (lat[None, :] < cur)
            best_t[:, ui, uj] = np.where(better, lat[None, :], cur)
            best_c[:, ui, uj] = np.where(better, ci, best_c[:, ui, uj])
            best_m[:, ui, uj] = np.where(better, mi, best_m[:, ui, uj])
    best_t[0] = INF
    return RangeTable(best_t, best_c, best_m, combos, meshes, choice)


@dataclass
class LayerArrays:
    """Per-layer figures of one (mesh, micro-batch, combo): what stage ranges sum."""

    c_t: np.ndarray          # prefix sums (length L + 1) of per-layer time per micro-batch
    c_rf: np.ndarray         # ... of forward compute + communication (recomputed stages)
    c_tr: np.ndarray         # ... of transitions (index l: between l - 1 and l)
    c_trf: np.ndarray        # ... of their forward part
    c_b: np.ndarray          # ... of backward compute
    c_fb: np.ndarray         # ... of forward + backward compute
    c_act: np.ndarray        # ... of kept activations
    c_psi: np.ndarray        # (L + 1, 4) ... of local parameters per bucket
    peak: np.ndarray         # per layer: a recomputed layer's full activations
    gathered: np.ndarray     # per layer: parameter bytes when gathered
    checkpoint: bool
    _sparse: tuple = None        # sparse tables of both per-layer maxima (built on first use)

    def range_max(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(max peak, max gathered) over layers [a_k, b_k) (non-empty ranges), by sparse
        tables: level k holds the maximum over [i, i + 2^k)."""
        if self._sparse is None:
            self._sparse = (_sparse_table(self.peak), _sparse_table(self.gathered))
        k = np.floor(np.log2(b - a)).astype(int)
        span = 1 << k
        return tuple(np.maximum(t[k, a], t[k, b - span]) for t in self._sparse)


def _sparse_table(x: np.ndarray) -> np.ndarray:
    n = len(x)
    levels = max(1, int(np.floor(np.log2(max(n, 1)))) + 1)
    out = np.zeros((levels, n))
    out[0] = x
    for k in range(1, levels):
        half = 1 << (k - 1)
        out[k, :n - half] = np.maximum(out[k - 1, :n - half], out[k - 1, half:])
    return out


def layer_arrays(ev: Evaluator, mesh: LogicalMesh, micro_batch: int, kt: dict,
                 pick: dict[str, int], checkpoint: bool) -> LayerArrays:
    ms = ev.ms
    kinds = ms.layer_kind
    n_layers = len(kinds)
    rows = [kt[k] for k in kinds]
    sel = [pick[k] for k in kinds]
    rec = np.array([checkpoint and ms.is_block[l] for l in range(n_layers)])
    f = np.array([r.f[s] for r, s in zip(rows, sel)])
    b = np.array([r.b[s] for r, s in zip(rows, sel)])
    cf = np.array([r.cf[s] for r, s in zip(rows, sel)])
    cb = np.array([r.cb[s] for r, s in zip(rows, sel)])
    act_full = np.array([r.act[s] for r, s in zip(rows, sel)])
    kept = np.array([r.kept[s] for r, s in zip(rows, sel)])
    psi = np.array([r.psi[s] for r, s in zip(rows, sel)])
    gath = np.array([r.gathered[s] for r, s in zip(rows, sel)])
    trans = np.zeros(n_layers)
    trans_f = np.zeros(n_layers)
    pairs: dict[tuple[str, str], tuple[float, float]] = {}
    for l in range(1, n_layers):
        ka, kb = kinds[l - 1], kinds[l]
        if (ka, kb) not in pairs:
            pairs[(ka, kb)] = ev.transition_time(ka, kb, mesh, micro_batch,
                                                 kt[ka].layouts[pick[ka]],
                                                 kt[kb].layouts[pick[kb]])
        tf, tb = pairs[(ka, kb)]
        trans[l] = tf + tb
        trans_f[l] = tf
    z1 = lambda x: np.concatenate([[0.0], np.cumsum(x)])          # noqa: E731
    return LayerArrays(z1(f + b + cf + cb), z1(f + cf), z1(trans), z1(trans_f), z1(b), z1(f + b),
                       z1(np.where(rec, kept, act_full)),
                       np.vstack([np.zeros(len(BUCKETS)), np.cumsum(psi, axis=0)]),
                       np.where(rec, act_full, 0.0), gath, checkpoint)


@dataclass
class RangeCosts:
    """Figures of stages covering layers [a, b) for several b (arrays over b)."""

    t: np.ndarray            # per micro-batch, sends excluded
    u: np.ndarray            # per step: exposed gradient sync, ZeRO-3 gathers, optimizer
    states: np.ndarray       # bytes of parameters, gradients, optimizer states
    act: np.ndarray          # bytes kept per micro-batch in flight
    fixed: np.ndarray        # bytes independent of in-flight: recompute peak, ZeRO-3 buffers
    send: np.ndarray         # seconds per micro-batch of sending the output (and its grad)


def range_costs(ev: Evaluator, la: LayerArrays, mesh: LogicalMesh, micro_batch: int, m: int,
                zero: int, a: np.ndarray, b: np.ndarray) -> RangeCosts:
    """Stages of layers [a_k, b_k) for arrays ``a``, ``b`` (module docstring's formulas)."""
    from autoplan.cost.comm import Group

    n_layers = len(la.peak)
    groups = [mesh.group(axes) for axes in BUCKETS]
    synced = [k for k, g in enumerate(groups) if g.size > 1]
    dsize = np.array([g.size for g in groups], dtype=float)
    div = np.where(dsize > 1, dsize, 1.0)
    t = la.c_t[b] - la.c_t[a] + (la.c_tr[b] - la.c_tr[a + 1])
    if la.checkpoint:
        t = t + la.c_rf[b] - la.c_rf[a] + (la.c_trf[b] - la.c_trf[a + 1])
    bwd = la.c_b[b] - la.c_b[a]
    fb = la.c_fb[b] - la.c_fb[a]
    ps = la.c_psi[b] - la.c_psi[a]
    sync = np.zeros(len(a))
    for k in synced:
        sync += _coll_vec(_line(ev, "all_reduce", groups[k]), ps[:, k] * REDUCE_BYTES)
    u = np.where(sync > 0, np.maximum(sync - (1 - OVERLAP_COST) * bwd, OVERLAP_COST * sync),
                 0.0)
    if zero == 3:
        gat = np.zeros(len(a))
        for k in synced:
            gat += _coll_vec(_line(ev, "all_gather", groups[k]), ps[:, k] * ev.cm.param_bytes)
        u = u + m * np.where(gat > 0, np.maximum(2 * gat - (1 - OVERLAP_COST) * fb,
                                                 OVERLAP_COST * 2 * gat), 0.0)
    local = (ps / div).sum(axis=1) if zero >= 1 else ps.sum(axis=1)
    u = u + ev.cm.compute.optimizer_time(1.0) * local
    p_b, g_b, o_b = ev.cm.state_bytes
    states = (ps * (p_b / (div if zero >= 3 else 1) + g_b / (div if zero >= 2 else 1)
                    + o_b / (div if zero >= 1 else 1))).sum(axis=1)
    act = la.c_act[b] - la.c_act[a]
    fixed, gathered = la.range_max(a, b)
    if zero == 3 and synced:
        fixed = fixed + 2 * gathered * (ps[:, synced].sum(axis=1) > 0)
    out_bytes = ev.output_bytes[np.maximum(b - 1, 0)]
    cross = ev.cm.cluster.nodes > 1 and 2 * mesh.size > ev.cm.cluster.devices_per_node
    line = _line(ev, "send_recv", Group(size=2, ranks_per_node=1 if cross else 2))
    send = np.where(b == n_layers, 0.0,
                    2 * _coll_vec(line, out_bytes * micro_batch / ev.b0 / mesh.size))
    return RangeCosts(t, u, states, act, fixed, send)
