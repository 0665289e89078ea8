"""Stage latency tables for the inter-op DP: every unit range on every submesh at once.

For one logical mesh and micro-batch, each layer kind has a few candidate *layouts* (one
placement per op group, :mod:`autoplan.planner.search.library`), priced per layer by
:func:`~autoplan.planner.search.kind_tables.kind_table` (compute, layer communication,
activations, parameters per sync bucket). A stage's configuration is then a *combo*
(lambda, ZeRO stage z, recomputation): each kind takes the layout minimising

    score = t + (OVERLAP_COST sync + optimizer) / m + lambda (states_z + act)

(a Lagrangian split of the stage's memory budget over its kinds), and
:func:`range_table` sums the per-layer figures over every range of units with prefix sums::

    t(i, j)     = sum_l (t_l [+ t_fwd,l + c_fwd,l if recomputed]) + sum of transitions
                  + 2 send + u(i, j) / m
    u(i, j)     = _exposed(all-reduce(psi), bwd) [+ m _exposed(2 all-gather(psi), fwd+bwd)]
                  + optimizer(psi / D^{[z>=1]})
    mem(i,j,s)  = states_z(psi) + s act(i, j) + peak(i, j) [+ 2 gathered(i, j) if z = 3]

and keeps, for each stage position s (micro-batches in flight), the fastest combo that fits:
w states + s act + fixed <= the budget, with w the states' weight against a budget that
holds back the allocator reserve on transient bytes only
(:func:`~autoplan.cost.memory.solver_state_weight`).
Everything here is arrays; the exact price of what the DP picks comes from the evaluator.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from autoplan.cost.memory import solver_state_weight
from autoplan.cost.step import REDUCE_BYTES, gathers_back, memory_zero, reductions_per_step
from autoplan.planner.search.costs import BUCKETS
from autoplan.planner.grid.estimate import OVERLAP_COST
from autoplan.planner.search.evaluate import Evaluator
from autoplan.planner.search.kind_tables import COLUMNS
from autoplan.planner.search.mesh import LogicalMesh

INF = math.inf


def _line(ev: Evaluator, collective: str, group) -> tuple[float, float]:
    """(alpha, seconds per byte) of ``collective`` on ``group`` (0, 0 for one rank)."""
    return ev.cm.line(collective, group)


def _coll_vec(line: tuple[float, float], nbytes: np.ndarray) -> np.ndarray:
    alpha, beta = line
    return np.where(nbytes > 0, alpha + beta * nbytes, 0.0)


@dataclass
class RangeTable:
    """Best stage latency per (position s, unit range) on one submesh, and what gave it."""

    time: np.ndarray                   # (S + 1, U, U + 1)
    combo: np.ndarray                  # (S + 1, U, U + 1) index into ``combos``
    mesh: np.ndarray                   # (S + 1, U, U + 1) index into ``meshes``
    combos: list[tuple[float, int, bool]]
    meshes: list[LogicalMesh]
    choice: dict[tuple[int, int], dict[str, int]]   # (mesh idx, combo idx) -> kind -> row


class Combos(list):
    """The combos (lambda or a coherent solution, ZeRO stage, recomputation) of a search, with
    the arrays :func:`pick_layouts` scores them by, built once rather than per mesh and
    micro-batch count."""

    @functools.cached_property
    def arrays(self) -> tuple:
        """(indices of the lambda combos, their lambda, z, full, selective and op-level
        recomputation as columns; the coherent combos as {solution: [indices]})."""
        free = [i for i, c in enumerate(self) if not isinstance(c[0], tuple)]
        lam = np.array([self[i][0] for i in free], dtype=float)[:, None]
        zs = np.array([self[i][1] for i in free], dtype=np.int64)
        cks = np.array([self[i][2] is True for i in free], dtype=bool)[:, None]
        sels = np.array([self[i][2] == "selective" for i in free], dtype=bool)[:, None]
        ops = np.array([self[i][2] == "op" for i in free], dtype=bool)[:, None]
        fixed: dict = {}
        for i, c in enumerate(self):
            if isinstance(c[0], tuple):
                fixed.setdefault(c[0], []).append(i)
        return np.array(free, dtype=np.int64), lam, zs, cks, sels, ops, fixed


def pick_layouts(ev: Evaluator, kt: dict, mesh: LogicalMesh, m: int,
                 combos: list[tuple[float, int, bool]]) -> list[dict[str, int]]:
    """Per combo, per kind: the layout row minimising the combo's score (module docstring)."""
    ms = ev.ms
    groups = [mesh.group(axes) for axes in BUCKETS]
    dsize = np.array([g.size for g in groups], dtype=float)
    div = np.where(dsize > 1, dsize, 1.0)
    p_b, g_b, o_b = ev.cm.state_bytes
    opt_rate = ev.cm.compute.optimizer_time(1.0)
    combos = combos if isinstance(combos, Combos) else Combos(combos)
    free, lam, zs, cks, sels, ops, fixed = combos.arrays
    finite = np.isfinite(lam)
    # bytes per parameter of each bucket at each combo's ZeRO stage: (C, 4)
    per = (p_b / np.where(zs[:, None] >= 3, div, 1.0) + g_b / np.where(zs[:, None] >= 2, div, 1.0)
           + o_b / np.where(zs[:, None] >= 1, div, 1.0))
    opt_div = np.where(zs[:, None] >= 1, div, 1.0)
    picks: list[dict[str, int] | None] = [None] * len(combos)
    for c in free.tolist():
        picks[c] = {}
    for k, t in kt.items():
        states = per @ t.psi.T                                        # (C, L)
        sync = sum(_coll_vec(_line(ev, "all_reduce", groups[bi]), t.psi[:, bi] * REDUCE_BYTES)
                   for bi in range(len(BUCKETS)))
        opt = opt_rate * ((1.0 / opt_div) @ t.psi.T)                  # (C, L)
        rec = cks & ms.is_block[ms.kinds[k].layer]
        sel = sels & ms.is_block[ms.kinds[k].layer]
        op = ops & ms.is_block[ms.kinds[k].layer]
        tl = t.f + t.b + t.cf + t.cb + np.select([rec, sel, op], [t.f + t.cf, t.sf,
                                                                  t.of + t.oc], 0.0)
        mem = states + np.select([rec, sel, op], [t.kept, t.act - t.sact, t.kept + t.oact],
                                 t.act)
        score = np.where(finite, tl + (OVERLAP_COST * sync + opt) / m +
                         np.where(finite, lam, 0.0) * mem, mem + 1e-9 * tl)
        best = np.argmin(score, axis=1)
        for c, row in zip(free.tolist(), best.tolist()):
            picks[c][k] = row
    # "coherent" combos: every kind takes the layout one whole-model ILP solve gave it (the
    # solve priced the transitions between kinds, which per-kind scores leave out)
    for solution, where in fixed.items():
        layouts = dict(solution)
        rows = {k: kt[k].row_of.get(layouts.get(k)) for k in kt}
        valid = None not in rows.values()
        for c in where:
            picks[c] = dict(rows) if valid else None
    return picks


def range_table(ev: Evaluator, meshes: list[LogicalMesh], micro_batch: int, m: int,
                units: list[int], max_stages: int, tables: dict, arrays, *,
                combos: list[tuple[float, int, bool]], memory: float,
                priced: "SharedRows | None" = None) -> RangeTable:
    """(module docstring) ``units``: layer index where each unit starts, plus the end;
    ``tables[(kind, mesh)]``: the :class:`~autoplan.planner.search.kind_tables.KindTable`
    of each kind (None: no valid layout);
    ``arrays(mesh, kt, pick, checkpoint)``: cached :func:`layer_arrays`; ``priced``: the
    :class:`SharedRows` of this micro-batch count, if the caller keeps one.

    Per mesh, the distinct (layouts, z, recomputation) of the combos are priced as the rows
    of one (rows x ranges) array (:func:`priced_rows`), and the fastest row that fits is
    taken per position at once: the first of equal ones, as a scan of the combos in order
    keeping strictly faster ones would."""
    ms = ev.ms
    u_count = len(units) - 1
    s1 = max_stages + 1
    weight = solver_state_weight(ev.step.gpu)         # the states against ``memory``
    choice: dict[tuple[int, int], dict[str, int]] = {}
    kinds = list(dict.fromkeys(ms.layer_kind))
    ui, uj = np.triu_indices(u_count + 1, k=1)          # every unit range [i, j)
    keep = ui < u_count
    ui, uj = ui[keep], uj[keep]
    starts, ends = np.array(units)[ui], np.array(units)[uj]
    flat_t = np.full((s1, len(ui)), INF)
    flat_c = np.full(flat_t.shape, -1, dtype=np.int64)
    flat_m = np.full(flat_t.shape, -1, dtype=np.int64)
    flat_k = np.full(flat_t.shape, INF)          # the kept row's tie_key
    for mi, mesh in enumerate(meshes):
        kt = {k: tables.get((k, mesh)) for k in kinds}
        if any(v is None for v in kt.values()):
            continue
        rows, rc, picks = priced(mesh, kt, starts, ends) if priced is not None else \
            priced_rows(ev, mesh, micro_batch, m, kt, combos, arrays, starts, ends)
        choice.update({(mi, ci): p for ci, p in enumerate(picks) if p is not None})
        if not rows:
            continue
        lat = rc.t + rc.send + rc.u / m                                 # (R, P)
        val, k = fastest_fitting(lat, weight * rc.states, rc.act, rc.fixed, memory, s1)
        key = np.take_along_axis(tie_key(rc.states, rc.act, rc.fixed), k, axis=0)
        # a faster row, or as fast on less memory (an earlier mesh on a full tie)
        better = (val < flat_t) | ((val == flat_t) & (key < flat_k))
        flat_t = np.where(better, val, flat_t)
        flat_c = np.where(better, np.array(rows)[k], flat_c)
        flat_m = np.where(better, mi, flat_m)
        flat_k = np.where(better, key, flat_k)
    best_t = np.full((s1, u_count, u_count + 1), INF)
    best_c = np.full(best_t.shape, -1, dtype=np.int64)
    best_m = np.full(best_t.shape, -1, dtype=np.int64)
    best_t[:, ui, uj] = flat_t
    best_c[:, ui, uj] = flat_c
    best_m[:, ui, uj] = flat_m
    best_t[0] = INF
    return RangeTable(best_t, best_c, best_m, combos, meshes, choice)


def last_fitting(states: np.ndarray, act: np.ndarray, fixed: np.ndarray, memory: float,
                 s1: int) -> np.ndarray:
    """Per entry, the largest position s in [0, s1) with ``states + s act + fixed <=
    memory`` (-1: none): memory grows with the micro-batches in flight (act >= 0), so the
    positions that fit are 0..s. Solved in closed form, then corrected by the exact
    comparison (the same floating-point expression the fit is decided by)."""
    def fits(s):
        return (states + s * act) + fixed <= memory

    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.floor((memory - states - fixed) / np.where(act > 0, act, 1.0))
    guess = np.where(act > 0, guess, np.where(fits(0), s1 - 1, -1))
    s = np.clip(np.nan_to_num(guess, nan=-1.0, posinf=s1 - 1, neginf=-1.0), -1, s1 - 1)
    s = s.astype(np.int64)
    for _ in range(4):          # rounding moves the closed form by at most one either way
        up = (s + 1 < s1) & fits(s + 1)
        down = (s >= 0) & ~fits(np.maximum(s, 0))
        if not up.any() and not down.any():
            break
        s = s + up - down
    return s


def tie_key(states: np.ndarray, act: np.ndarray, fixed: np.ndarray) -> np.ndarray:
    """What breaks a tie between stage configurations of equal latency: the bytes they hold
    with one micro-batch in flight, the least first. Rows of equal latency differ, e.g., in
    the ZeRO stage alone when the stage's gradient sync and optimizer hide behind compute
    the same way: the tables price them alike, and the one sharding more is the one whose
    exact memory (:mod:`autoplan.cost.step`, which also counts what the tables leave out --
    communicator buffers, temporaries, the allocator's reserve) is likelier to fit. (The
    first of equal latencies, in combo order, picked ZeRO-1 over an equally fast ZeRO-2
    for GPT-1.7B on 32 A100s; the exact check then rejected it at 85.6 of 84.2 GB, and the
    search missed the uniform grid's plan, issue #18.)"""
    return states + act + fixed


def fastest_fitting(lat: np.ndarray, states: np.ndarray, act: np.ndarray, fixed: np.ndarray,
                    memory: float, s1: int) -> tuple[np.ndarray, np.ndarray]:
    """For rows (R, P) of stage latencies and memory terms: per position s < s1 and column,
    the smallest latency among the rows that fit at s (``states + s act + fixed <=
    memory``) and its row: of equal latencies the least :func:`tie_key`, then the first
    (INF and row 0 where none fits) -- ``argmin`` over the (s1, R, P) array of fitting
    (latency, tie key), without building it: rows sorted by latency then tie key, the
    running maximum of their :func:`last_fitting` position; the best row at s is the first
    whose running maximum reaches s."""
    r_count, p_count = lat.shape
    key = tie_key(states, act, fixed)
    if s1 <= FEW_POSITIONS:
        return _fastest_fitting_per_position(lat, last_fitting(states, act, fixed, memory,
                                                               s1), s1, key)
    order = np.lexsort((key, lat), axis=0)                           # (R, P), stable
    sorted_lat = np.take_along_axis(lat, order, axis=0)
    reach = np.maximum.accumulate(np.take_along_axis(
        last_fitting(states, act, fixed, memory, s1), order, axis=0), axis=0)
    # rows before the first reaching s: those whose running maximum is below s
    cells = (np.arange(p_count) * (s1 + 1) + (reach + 1)).ravel()
    counts = np.bincount(cells, minlength=p_count * (s1 + 1)).reshape(p_count, s1 + 1)
    first = np.cumsum(counts, axis=1)[:, :s1].T                          # (s1, P)
    found = first < r_count
    at = np.minimum(first, r_count - 1)
    cols = np.arange(p_count)[None, :]
    val = np.where(found, sorted_lat[at, cols], INF)
    row = np.where(found, order[at, cols], 0)
    return val, row


#: up to this many positions, :func:`fastest_fitting` masks the rows per position instead
#: of sorting them (a stable sort of every column costs about as much as 15 masked minima)
FEW_POSITIONS = 12


def _fastest_fitting_per_position(lat: np.ndarray, last: np.ndarray, s1: int,
                                  key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fastest_fitting` one position at a time (``last``: :func:`last_fitting`;
    ``key``: :func:`tie_key`): per column, of the rows that fit at s and have the least
    latency, the first of least key (INF and row 0 where none fits; where all fitting ones
    are INF, the first fitting row of least key, as the sorted scan finds it)."""
    lat_t = np.ascontiguousarray(lat.T)                          # (P, R): rows contiguous
    last_t = np.ascontiguousarray(last.T)
    key_t = np.ascontiguousarray(key.T)
    val = np.empty((s1, lat.shape[1]))
    row = np.empty((s1, lat.shape[1]), dtype=np.int64)
    for s in range(s1):
        fit = last_t >= s
        masked = np.where(fit, lat_t, INF)
        val[s] = masked.min(axis=1)
        # the least key among the rows at the least latency (all fitting rows where none
        # is finite: masked == INF there)
        tied = fit & (masked == val[s][:, None])
        r = np.where(tied, key_t, INF).argmin(axis=1)
        row[s] = np.where(tied.any(axis=1), r, 0)
    return val, row


#: columns of ``LayerArrays.cum``
T, RF, TR, TRF, BWD, FB, ACT, PSI = 0, 1, 2, 3, 4, 5, 6, 7


@dataclass
class LayerArrays:
    """Per-layer figures of one (mesh, micro-batch, combo): what stage ranges sum.

    ``cum`` (L + 1, 7 + 4) holds their prefix sums, one column each: T per-layer time per
    micro-batch, RF forward compute + communication (recomputed stages), TR transitions
    (index l: between l - 1 and l), TRF their forward part, BWD backward compute, FB
    forward + backward compute, ACT kept activations, PSI.. local parameters per bucket."""

    cum: np.ndarray
    peak: np.ndarray         # per layer: a recomputed layer's full activations (selective:
    gathered: np.ndarray     # its attention matrices); per layer: parameter bytes gathered
    checkpoint: bool         # full recomputation (selective and op-level add to T)
    per: np.ndarray = None       # (L, 16) each layer's KindTable.columns (layer_arrays)


def _sparse_table(x: np.ndarray) -> np.ndarray:
    """Sparse table of the rows of ``x`` (K, n): (K, levels, n), level k holding the
    maximum over [i, i + 2^k), so the maximum over [a, b) is that of level
    floor(log2(b - a)) at a and at b - 2^k (:func:`range_base`)."""
    rows, n = x.shape
    levels = max(1, int(np.floor(np.log2(max(n, 1)))) + 1)
    out = np.zeros((rows, levels, n))
    out[:, 0] = x
    for k in range(1, levels):
        half = 1 << (k - 1)
        out[:, k, :n - half] = np.maximum(out[:, k - 1, :n - half], out[:, k - 1, half:])
    return out


def layer_arrays(ev: Evaluator, mesh: LogicalMesh, micro_batch: int, kt: dict,
                 pick: dict[str, int], checkpoint: bool | str,
                 plain: LayerArrays | None = None) -> LayerArrays:
    """``checkpoint``: False, True (full recomputation of the blocks), 'selective' or 'op'.
    ``plain``: the same layouts' arrays without recomputation, if at hand: recomputation
    changes only the columns it touches (ACT; selective and op also T, BWD, FB), so the rest --
    the per-layer gather, the transitions, their prefix sums -- is taken from it."""
    order, kidx, pairs, pidx, is_block = ev.ms.layer_index
    n_layers = len(kidx)
    if plain is not None and checkpoint is not False:
        per = plain.per
    else:
        plain = None
        # each layer takes its kind's pick: (L, 16) columns of KindTable.columns
        per = np.stack([kt[k].columns[pick[k]] for k in order])[kidx]
    f, b, cf, cb, act_full, kept, gath, sf, sact, of, oc, oact = per[:, :COLUMNS].T
    rec = is_block & (checkpoint is True)
    part = is_block & (checkpoint == "selective")
    op = is_block & (checkpoint == "op")
    partial = bool(part.any()) or bool(op.any())
    # selective: the attention core again, its matrices not kept; op-level: the input and
    # kept outputs, the rest and its collectives again (a full layer at its recompute peak)
    b = b + np.select([part, op], [sf, of + oc], 0.0)
    peak_sel = np.select([part, op], [sact, act_full], 0.0)
    act_full = np.select([part, op], [act_full - sact, kept + oact], act_full)
    if plain is not None:
        cols = plain.cum.copy()
        body = cols[1:]
        touched = [ACT] + ([T, BWD, FB] if partial else [])
    else:
        cols = np.empty((n_layers + 1, PSI + len(BUCKETS)))
        cols[0] = 0.0
        body = cols[1:]
        touched = list(range(cols.shape[1]))
        body[:, RF] = f + cf
        body[:, TR] = 0.0
        body[:, TRF] = 0.0
        if n_layers > 1:       # the transition into layer l, per distinct (kind, next kind)
            tt = np.array([ev.transition_time(ka, kb, mesh, micro_batch, kt[ka].layouts[pick[ka]],
                                              kt[kb].layouts[pick[kb]])
                           for ka, kb in pairs], dtype=float)
            body[1:, TR] = tt[pidx, 0] + tt[pidx, 1]
            body[1:, TRF] = tt[pidx, 0]
        body[:, PSI:] = per[:, COLUMNS:]
    if T in touched:
        body[:, T] = f + b + cf + cb
        body[:, BWD] = b
        body[:, FB] = f + b
    body[:, ACT] = np.where(rec, kept, act_full)
    if len(touched) == cols.shape[1]:
        np.cumsum(body, axis=0, out=body)
    else:
        for c in touched:
            body[:, c] = np.cumsum(body[:, c])
    return LayerArrays(cols, np.where(rec, act_full, peak_sel), gath, checkpoint is True,
                       per=per)


@dataclass
class RangeCosts:
    """Figures of stages covering layers [a, b) for several b (arrays over b; a leading
    axis over the stacked :class:`LayerArrays` where there are several)."""

    t: np.ndarray            # per micro-batch, sends excluded
    u: np.ndarray            # per step: exposed gradient sync, ZeRO-3 gathers, optimizer
    states: np.ndarray       # bytes of parameters, gradients, optimizer states
    act: np.ndarray          # bytes kept per micro-batch in flight
    fixed: np.ndarray        # bytes independent of in-flight: recompute peak, ZeRO-3 buffers
    send: np.ndarray         # seconds per micro-batch of sending the output (and its grad)


@dataclass
class RangeBase:
    """The parts of :class:`RangeCosts` that depend neither on the ZeRO stage nor on m, for
    K stacked :class:`LayerArrays` (arrays (K, P) over P ranges; ``send`` (P,))."""

    t: np.ndarray
    bwd: np.ndarray          # backward compute (what hides the gradient sync)
    fb: np.ndarray           # forward + backward compute (what hides ZeRO-3 gathers)
    ps: np.ndarray           # (K, P, 4) local parameters per sync bucket
    div: np.ndarray          # (4,) each bucket's group size (1 for one rank)
    synced: list[int]        # buckets whose group has more than one rank
    sync: np.ndarray         # all-reduce seconds of the gradients
    scatter: np.ndarray      # reduce-scatter seconds of the gradients (ZeRO-2, per micro-batch)
    whole: np.ndarray        # (P,) the range is the whole model: a one-stage pipeline
    gather: np.ndarray       # all-gather seconds of the parameters (ZeRO-3)
    act: np.ndarray
    peak: np.ndarray         # max recompute peak over the range
    gathered: np.ndarray     # max gathered parameter bytes over the range
    send: np.ndarray
    memo: dict = field(default_factory=dict)      # terms finish_range shares across z


def range_base(ev: Evaluator, las: list[LayerArrays], mesh: LogicalMesh, micro_batch: int,
               a: np.ndarray, b: np.ndarray) -> RangeBase:
    """The z- and m-independent sums over layers [a_k, b_k) (module docstring) of every
    :class:`LayerArrays` in ``las`` at once (one array operation per term, not one per
    layout, recomputation and range)."""
    from autoplan.cost.comm import Group

    n_layers = len(las[0].peak)
    groups = [mesh.group(axes) for axes in BUCKETS]
    synced = [k for k, g in enumerate(groups) if g.size > 1]
    dsize = np.array([g.size for g in groups], dtype=float)
    div = np.where(dsize > 1, dsize, 1.0)
    cum = np.stack([la.cum for la in las])              # (K, L + 1, columns)
    hi, lo = cum[:, b], cum[:, a]
    d = hi - lo                                           # (K, P, columns): [a, b) sums
    tr = hi[..., TR:TRF + 1] - cum[:, a + 1, TR:TRF + 1]  # transitions inside [a, b)
    t = d[..., T] + tr[..., 0]
    ck = np.array([la.checkpoint for la in las])
    if ck.any():
        t = np.where(ck[:, None], t + hi[..., RF] - lo[..., RF] + tr[..., 1], t)
    bwd = d[..., BWD]
    fb = d[..., FB]
    ps = np.ascontiguousarray(d[..., PSI:])
    sync = np.zeros(bwd.shape)
    scatter = np.zeros(bwd.shape)
    gather = np.zeros(bwd.shape)
    for k in synced:
        sync += _coll_vec(_line(ev, "all_reduce", groups[k]), ps[..., k] * REDUCE_BYTES)
        scatter += _coll_vec(_line(ev, "reduce_scatter", groups[k]), ps[..., k] * REDUCE_BYTES)
        gather += _coll_vec(_line(ev, "all_gather", groups[k]), ps[..., k] * ev.cm.param_bytes)
    act = d[..., ACT]
    level = np.floor(np.log2(b - a)).astype(int)          # sparse tables (_sparse_table)
    span = 1 << level
    peak_t = _sparse_table(np.stack([la.peak for la in las]))
    gath_t = _sparse_table(np.stack([la.gathered for la in las]))
    peak = np.maximum(peak_t[:, level, a], peak_t[:, level, b - span])
    gathered = np.maximum(gath_t[:, level, a], gath_t[:, level, b - span])
    out_bytes = ev.output_bytes[np.maximum(b - 1, 0)]
    cross = ev.cm.cluster.nodes > 1 and 2 * mesh.size > ev.cm.cluster.devices_per_node
    line = _line(ev, "send_recv", Group(size=2, ranks_per_node=1 if cross else 2))
    send = np.where(b == n_layers, 0.0,
                    2 * _coll_vec(line, out_bytes * micro_batch / ev.b0 / mesh.size))
    whole = (a == 0) & (b == n_layers)
    return RangeBase(t, bwd, fb, ps, div, synced, sync, scatter, whole, gather, act, peak,
                     gathered, send)


def _sum_last(x: np.ndarray) -> np.ndarray:
    """``x.sum(axis=-1)`` for a short last axis (the four sync buckets), its columns added
    in order: numpy adds a short axis in order too (bit for bit the same sums,
    tests/test_search_fast_paths.py), but a reduction over a length-4 axis costs several
    times four whole-array additions."""
    out = x[..., 0].copy()
    for k in range(1, x.shape[-1]):
        out += x[..., k]
    return out


def _hinge(comm: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Seconds a collective adds beside ``window`` seconds of compute (cost.overlap's
    x(C, W) without the last bucket)."""
    return np.where(comm > 0, np.maximum(comm - (1 - OVERLAP_COST) * window,
                                         OVERLAP_COST * comm), 0.0)


def finish_range(ev: Evaluator, base: RangeBase, m: int, zero: int) -> RangeCosts:
    """:class:`RangeCosts` of ``base`` at ZeRO stage ``zero`` with ``m`` micro-batches.
    ZeRO-2 over m > 1 micro-batches as :mod:`autoplan.cost.step` prices it: a range that is
    the whole model (one stage) reduce-scatters every micro-batch and keeps its gradients
    sharded; a pipeline stage accumulates them unsharded and reduces once (ZeRO-1)."""
    sync, ps, div, synced = base.sync, base.ps, base.div, base.synced
    memo = base.memo               # the terms shared by the ZeRO stages, computed once
    if "sync" not in memo:
        memo["sync"] = _hinge(sync, base.bwd)
        memo["scatter"] = _hinge(base.scatter, base.bwd)
        memo["regather"] = _hinge(base.gather, base.fb - base.bwd)
    sharded = gathers_back(zero, shared=ev.composer is not None)   # as cost.step prices it
    u = memo["scatter"] if sharded else memo["sync"]
    # a range that is the whole model runs as one stage, any other as a pipeline stage
    reps = reductions_per_step(zero, m, pipelined=False)
    if reps > 1:                    # reduce-scatters over every micro-batch's backward
        u = np.where(base.whole, reps * memo["scatter"], u)
    if sharded:
        u = u + memo["regather"]
    grads_div = np.where(base.whole[:, None],
                         div if memory_zero(zero, m, pipelined=False) >= 2 else 1.0,
                         div if memory_zero(zero, m, pipelined=True) >= 2 else 1.0)
    if zero == 3:
        if "gather" not in memo:
            gat = base.gather
            memo["gather"] = np.where(gat > 0, np.maximum(2 * gat - (1 - OVERLAP_COST) * base.fb,
                                                          OVERLAP_COST * 2 * gat), 0.0)
        u = u + m * memo["gather"]
    key = "local" if zero >= 1 else "whole"
    if key not in memo:
        memo[key] = _sum_last(ps / div) if zero >= 1 else _sum_last(ps)
    u = u + ev.cm.compute.optimizer_time(1.0) * memo[key]
    p_b, g_b, o_b = ev.cm.state_bytes
    states = _sum_last(ps * (p_b / (div if zero >= 3 else 1) + g_b / grads_div
                             + o_b / (div if zero >= 1 else 1)))
    fixed = base.peak
    if zero == 3 and synced:
        fixed = fixed + 2 * base.gathered * (ps[..., synced].sum(axis=-1) > 0)
    return RangeCosts(base.t, u, states, base.act, fixed, base.send)


def priced_rows(ev: Evaluator, mesh: LogicalMesh, micro_batch: int, m: int, kt: dict,
                combos: list[tuple[float, int, bool]], arrays, a: np.ndarray, b: np.ndarray
                ) -> tuple[list[int], RangeCosts | None, list[dict[str, int] | None]]:
    """The combos of ``mesh`` with distinct (layouts, z, recomputation), in combo order, and
    their :class:`RangeCosts` over ranges [a_k, b_k) as rows (R, P); also every combo's
    layouts (:func:`pick_layouts`; None where a coherent layout is not valid here)."""
    picks = pick_layouts(ev, kt, mesh, m, combos)
    rows: list[int] = []
    which: list[tuple[int, int]] = []          # (row of its LayerArrays, z)
    lay_of: dict[tuple, int] = {}
    las: list[LayerArrays] = []
    done: set[tuple] = set()
    for ci, (lam, z, ck) in enumerate(combos):
        pick = picks[ci]
        if pick is None:
            continue
        key = (tuple(sorted(pick.items())), z, ck)
        if key in done:                 # another lambda picked the same layouts
            continue
        done.add(key)
        if (key[0], ck) not in lay_of:
            lay_of[(key[0], ck)] = len(las)
            las.append(arrays(mesh, kt, pick, ck))
        rows.append(ci)
        which.append((lay_of[(key[0], ck)], z))
    if not rows:
        return rows, None, picks
    base = range_base(ev, las, mesh, micro_batch, a, b)
    zs = sorted({z for _, z in which})
    per_z = {z: finish_range(ev, base, m, z) for z in zs}
    k_of = np.array([k for k, _ in which])
    z_of = np.array([zs.index(z) for _, z in which])

    def gather(field: str) -> np.ndarray:
        return np.array([getattr(per_z[z], field) for z in zs])[z_of, k_of]

    rc = RangeCosts(base.t[k_of], gather("u"), gather("states"), base.act[k_of],
                    gather("fixed"), base.send)
    return rows, rc, picks


class SharedRows:
    """:func:`priced_rows` of one micro-batch count, once per mesh over the ranges of all its
    callers: the stage DP's unit ranges (:func:`range_table`) and the balanced pipelines'
    chunks (``extra``: mesh size -> (starts, ends)). Every figure of a range depends on that
    range alone (elementwise array operations), so a caller's columns equal, bit for bit,
    those of a call over its ranges only (tests/test_search_fast_paths.py); the layouts per
    combo (:func:`pick_layouts`) and the stacked layer arrays are computed once."""

    def __init__(self, ev: Evaluator, micro_batch: int, m: int, combos, arrays,
                 extra: dict[int, tuple[np.ndarray, np.ndarray]]):
        self.ev, self.micro_batch, self.m = ev, micro_batch, m
        self.combos, self.arrays, self.extra = combos, arrays, extra
        self._done: dict[LogicalMesh, tuple] = {}

    def __call__(self, mesh: LogicalMesh, kt: dict, a: np.ndarray, b: np.ndarray
                 ) -> tuple[list[int], RangeCosts | None, list[dict[str, int] | None]]:
        hit = self._done.get(mesh)
        if hit is None:
            ea, eb = self.extra.get(mesh.size, (a[:0], b[:0]))
            both_a, both_b = np.concatenate([a, ea]), np.concatenate([b, eb])
            rows, rc, picks = priced_rows(self.ev, mesh, self.micro_batch, self.m, kt,
                                          self.combos, self.arrays, both_a, both_b)
            col: dict[tuple[int, int], int] = {}
            for k, key in enumerate(zip(both_a.tolist(), both_b.tolist())):
                col.setdefault(key, k)
            hit = self._done[mesh] = (rows, rc, picks, col)
        rows, rc, picks, col = hit
        if rc is None:
            return rows, rc, picks
        want = [col.get(key) for key in zip(a.tolist(), b.tolist())]
        if None in want:                 # ranges nobody announced: priced on their own
            return priced_rows(self.ev, mesh, self.micro_batch, self.m, kt, self.combos,
                               self.arrays, a, b)
        if want == list(range(len(want))):
            idx = slice(0, len(want))
        else:
            idx = np.array(want, dtype=np.int64)
        return rows, RangeCosts(rc.t[:, idx], rc.u[:, idx], rc.states[:, idx],
                                rc.act[:, idx], rc.fixed[:, idx], rc.send[idx]), picks
