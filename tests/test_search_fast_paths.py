"""The search's fast paths give exactly what the direct computations give (issue #18).

Each fast path (packed candidate arrays, replayed edge buckets, one ILP build per memory
weight, layer arrays derived from the plain ones, the stage DP's skipped rows) is checked
bit for bit, or solution for solution, against the computation it replaces, on a 4-block
GPT on two DGX A100 nodes. Planning only: no engine runs.
"""

from __future__ import annotations


import numpy as np
import pytest

from autoplan.api import prepare
from autoplan.models import resolve
from autoplan.planner.search.compose import Composition, analyse, build_problem
from autoplan.planner.search.costs import CostModel
from autoplan.planner.search.evaluate import Evaluator
from autoplan.planner.search.inter_op import brute_force, pipeline_dp, stage_dp
from autoplan.planner.search.intra_op import solve, solve_weights
from autoplan.planner.search.library import LAMBDAS, ilp_weight
from autoplan.planner.search.mesh import LogicalMesh
from autoplan.planner.search.packed import PackedAnchor
from autoplan.planner.search.kind_tables import kind_table
from autoplan.planner.search.tables import Combos, _sparse_table, layer_arrays, pick_layouts
from stage_tables import random_stage_table

GPT_SMALL = dict(vocab_size=8192, hidden=1024, layers=4, heads=16, seq_len=1024)
MESHES = [LogicalMesh((2, 8), 8), LogicalMesh((4, 4), 8), LogicalMesh((16, 1), 8)]


@pytest.fixture(scope="module")
def small():
    problem = prepare(resolve("gpt", **GPT_SMALL), "dgx-a100", global_batch=64, nodes=2)
    ms = analyse(problem.spec, problem.graph)
    return problem, ms, Evaluator(CostModel(problem.graph, problem.cluster), ms)


def _loop_price(cm: CostModel, rows, mesh: LogicalMesh, scale: float) -> dict:
    """The per-candidate loop the packed arrays replace (``CostModel.kind_costs`` before
    issue #18), for the rows' records."""
    core, gemms = cm._core_and_gemms
    again = cm.op_sets[1]
    out = {k: [] for k in ("fwd", "bwd", "cof", "cf", "cb", "act", "orf", "okept")}
    for _, rec in rows:
        f = b = cof = orf = 0.0
        for name, tp, batch_split, batchy in rec.ops:
            tf, tb = cm.op_time(name, tp, scale / batch_split if batchy else 1.0)
            f += tf
            b += tb
            if name in core:
                cof += tf
            if name in again:
                orf += tf
        moves = [(d, c, ax, nb * (scale if sc else 1.0) / div)
                 for d, c, ax, nb, sc, div in rec.moves]
        out["fwd"].append(f)
        out["bwd"].append(b)
        out["cof"].append(cof)
        out["cf"].append(sum(cm.coll(c, x, mesh.group((ax,))) for d, c, ax, x in moves
                             if d == "fwd"))
        out["cb"].append(sum(cm.coll(c, x, mesh.group((ax,))) for d, c, ax, x in moves
                             if d == "bwd"))
        out["act"].append(sum(nb * (scale if batchy else 1.0) / shard
                              for nb, batchy, shard, _ in rec.saved))
        out["orf"].append(orf)
        out["okept"].append(sum(nb * scale / shard for nb, shard in rec.op_saved))
    return out


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.label())
def test_packed_candidates_price_as_the_loop_over_records(small, mesh):
    problem, ms, ev = small
    cm = ev.cm
    for kind, kg in ms.kinds.items():
        exported = ms.exported(kind)
        for ai in range(len(kg.anchors)):
            rows = cm._structure(kg, mesh.shape, exported)[ai]
            pk = PackedAnchor(rows, *cm._core_and_gemms, cm.op_sets[1])
            for micro_batch in (64, 16, 4):
                scale = micro_batch / cm.b0
                got = pk.price(cm, mesh, scale)
                want = _loop_price(cm, rows, mesh, scale)
                for key, values in want.items():
                    assert got[key].tolist() == [float(v) for v in values], (kind, ai, key)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.label())
def test_replayed_edge_buckets_equal_the_direct_ones(small, mesh):
    """layer_buckets without ``counts`` replays recorded additions; with ``counts`` it
    derives them directly: the buckets are equal, at two micro-batches."""
    problem, ms, ev = small
    for micro_batch in (64, 16):
        for kind in ms.kinds:
            kc = ev.kind_costs(kind, mesh, micro_batch)
            rng = np.random.default_rng(len(kind))
            for _ in range(6):
                choice = tuple(int(rng.integers(len(c))) for c in kc.cand)
                fast = ev.layer_buckets(kind, mesh, micro_batch, choice)
                direct = ev.layer_buckets(kind, mesh, micro_batch, choice, counts={})
                assert fast == direct


def test_one_ilp_build_per_mesh_solves_each_weight_as_a_fresh_build(small):
    problem, ms, ev = small
    comp = Composition.of(ms, 0, len(problem.graph.layers))
    mesh = LogicalMesh((2, 8), 8)
    costs = {k: ev.kind_costs(k, mesh, 16) for k, _ in comp.counts}
    ilp, _ = build_problem(ev.cm, ms, comp, mesh, 16, micro_batches=4, in_flight=1,
                           checkpoint=False, costs=costs)
    weights = [ilp_weight(w) for w in LAMBDAS]
    fresh = []
    for w in weights:
        ilp.mem_weight = w
        fresh.append(solve(ilp))
    got = list(solve_weights(ilp, weights, time_limit_s=lambda: 30.0))
    assert [(s.choice, s.zero, s.objective) for s in got] == \
        [(s.choice, s.zero, s.objective) for s in fresh]


def test_recomputed_layer_arrays_from_the_plain_ones_equal_a_full_build(small):
    problem, ms, ev = small
    mesh = LogicalMesh((4, 4), 8)
    kinds = list(dict.fromkeys(ms.layer_kind))
    kt = {}
    for k in kinds:
        kc = ev.kind_costs(k, mesh, 16)
        layouts = [tuple(int(c[j % len(c)]) for c in kc.cand) for j in range(3)]
        kt[k] = kind_table(ev, k, mesh, 16, layouts)
    combos = Combos([(lam, z, ck) for lam in (0.0, 1e-10) for z in (0, 3)
                     for ck in (False, True, "selective", "op")])
    for pick in pick_layouts(ev, kt, mesh, 4, combos):
        plain = layer_arrays(ev, mesh, 16, kt, pick, False)
        for ck in (True, "selective", "op"):
            full = layer_arrays(ev, mesh, 16, kt, pick, ck)
            derived = layer_arrays(ev, mesh, 16, kt, pick, ck, plain=plain)
            assert np.array_equal(full.cum, derived.cum)
            assert np.array_equal(full.peak, derived.peak)
            assert np.array_equal(full.gathered, derived.gathered)


def _loop_kind_table(ev, kind, mesh, micro_batch, layouts):
    """``kind_table`` as the per-layout loop of Python sums it replaces (issue #18)."""
    import math

    from autoplan.planner.search.compose import transition_edges
    from autoplan.planner.search.costs import BUCKETS, CORE_ACT, CORE_FWD, OP_ACT, OP_FWD

    kc = ev.kind_costs(kind, mesh, micro_batch)
    ms = ev.ms
    l = ms.kinds[kind].layer
    prev = ms.layer_kind[l - 1] if l else None

    def shard(spec):
        return math.prod(mesh.shape[a] for a in range(2)
                         if spec is not None and spec[a].startswith("S"))

    def imported(ch):
        if l == 0:
            return 0.0
        kc_a, out = ev.kind_costs(prev, mesh, micro_batch), 0.0
        for v, nbytes, specs in ms.imported(prev, kind, kc_a, kc):
            out += nbytes / shard(specs[ch[v]])
        return out

    def kept(ch):
        whole = ev.graph.layers[l].stats.input_bytes * micro_batch / ev.b0
        if l == 0:
            return whole
        seen = {}
        for e in transition_edges(ms, (prev, kind), ev.kind_costs(prev, mesh, micro_batch),
                                  kc):
            x = e.nbytes / shard(kc.in_info[(e.m, e.q)][1][ch[e.v]])
            seen[(e.p, e.o)] = min(seen.get((e.p, e.o), math.inf), x)
        return sum(seen.values()) if seen else whole

    pos = [{int(k): i for i, k in enumerate(c)} for c in kc.cand]
    valid = []
    for lay in layouts:
        idx = tuple(pos[ai].get(k) for ai, k in enumerate(lay))
        if None not in idx and idx not in valid:
            valid.append(idx)
    rows = []
    for ch in valid:
        fb, bb, moved = ev.layer_buckets(kind, mesh, micro_batch, ch)
        again = {k: v for k, v in fb.items() if k[1] != "reduce_scatter"}
        scattered = sum(v / mesh.shape[k[2]] for k, v in sorted(fb.items())
                        if k[1] == "reduce_scatter")
        psi = np.zeros(len(BUCKETS))
        for ai, j in enumerate(ch):
            for bi, axes in enumerate(BUCKETS):
                extra = moved.get(ai, ())
                psi[BUCKETS.index(tuple(sorted(set(axes) | set(extra))))] += kc.psi[ai][j][bi]
        rows.append(dict(
            f=sum(kc.fwd[ai][j] for ai, j in enumerate(ch)),
            b=sum(kc.bwd[ai][j] for ai, j in enumerate(ch)),
            cf=ev._time(fb, mesh), cb=ev._time(bb, mesh),
            act=sum(kc.act[ai][j] for ai, j in enumerate(ch)) + imported(ch),
            kept=kept(ch), psi=psi.tolist(),
            gathered=sum(kc.gathered[ai][j] for ai, j in enumerate(ch)),
            sf=sum(kc.extra[ai][j, CORE_FWD] for ai, j in enumerate(ch)),
            sact=sum(kc.extra[ai][j, CORE_ACT] for ai, j in enumerate(ch)),
            of=sum(kc.extra[ai][j, OP_FWD] for ai, j in enumerate(ch)),
            oc=ev._time(again, mesh),
            oact=sum(kc.extra[ai][j, OP_ACT] for ai, j in enumerate(ch)) + scattered))
    return valid, rows


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.label())
def test_kind_tables_equal_the_loop_over_layouts(small, mesh):
    """kind_table's arrays over layouts equal the per-layout sums bit for bit, for every
    kind (the first layer's, importing nothing, and those after it), at three micro-batches."""
    problem, ms, ev = small
    for micro_batch in (64, 16, 2):
        for kind in ms.kinds:
            kc = ev.kind_costs(kind, mesh, micro_batch)
            rng = np.random.default_rng(len(kind) + micro_batch)
            layouts = [tuple(int(c[rng.integers(len(c))]) for c in kc.cand)
                       for _ in range(8)]
            layouts.append(tuple(10 ** 6 for _ in kc.cand))      # invalid here: left out
            table = kind_table(ev, kind, mesh, micro_batch, layouts)
            valid, rows = _loop_kind_table(ev, kind, mesh, micro_batch, layouts)
            assert table.layouts == valid
            for field, values in (("f", table.f), ("b", table.b), ("cf", table.cf),
                                  ("cb", table.cb), ("act", table.act),
                                  ("kept", table.kept), ("psi", table.psi),
                                  ("gathered", table.gathered), ("sf", table.sf),
                                  ("sact", table.sact), ("of", table.of), ("oc", table.oc),
                                  ("oact", table.oact)):
                assert values.tolist() == [float(r[field]) if field != "psi" else r[field]
                                           for r in rows], (kind, micro_batch, field)


def _model(solver) -> list:
    """A solver's model (or a model proto) as comparable data: variables (bounds,
    integrality, objective coefficient), rows (bounds, coefficients by variable index), the
    sense; names left out."""
    from ortools.linear_solver import linear_solver_pb2

    proto = solver
    if not isinstance(solver, linear_solver_pb2.MPModelProto):
        proto = linear_solver_pb2.MPModelProto()
        solver.ExportModelToProto(proto)
    return [[(v.lower_bound, v.upper_bound, v.is_integer, v.objective_coefficient)
             for v in proto.variable],
            [(c.lower_bound, c.upper_bound, sorted(zip(c.var_index, c.coefficient)))
             for c in proto.constraint], proto.maximize]


@pytest.mark.parametrize("mesh", MESHES[:2], ids=lambda m: m.label())
def test_ilp_model_proto_equals_the_incremental_build(small, mesh):
    """IlpBuilder's one-proto model equals the coefficient-by-coefficient build, variable
    for variable and row for row, with a memory budget and every constraint family
    present; CBC's solutions at every memory weight are the same."""
    from autoplan.planner.search.intra_op import IlpBuilder, _run
    from ilp_incremental import IncrementalBuilder

    problem, ms, ev = small
    comp = Composition.of(ms, 0, len(problem.graph.layers))
    costs = {k: ev.kind_costs(k, mesh, 16) for k, _ in comp.counts}
    free, _ = build_problem(ev.cm, ms, comp, mesh, 16, micro_batches=4, in_flight=1,
                            checkpoint=False, costs=costs)
    least = solve(free).memory
    for budget in (float("inf"), 1.3 * least):
        ilp, _ = build_problem(ev.cm, ms, comp, mesh, 16, micro_batches=4, in_flight=1,
                               checkpoint=False, costs=costs, budget=budget,
                               mem_weight=1e-11)
        assert ilp.hinges and ilp.partials and ilp.mem_max and ilp.zmem
        new, old = IlpBuilder(ilp), IncrementalBuilder(ilp)
        new.build()
        old.build()
        assert _model(new.s) == _model(old.s) == _model(new.proto)
        for w in (ilp_weight(lam) for lam in LAMBDAS):
            new.reweight(w)
            old.reweight(w)
            # (the kept proto, which the LP relaxation starts from, follows the weight)
            assert _model(new.s) == _model(old.s) == _model(new.proto)
            at = ilp.__class__(**{**ilp.__dict__, "mem_weight": w})
            a, b = _run(new, at, 30.0, False, 0.0), _run(old, at, 30.0, False, 0.0)
            assert (a.choice, a.zero, a.objective) == (b.choice, b.zero, b.objective)


def _loop_edge_matrices(cm, kc_u, kc_v, edges, multi):
    """``costs._edge_matrices`` as a plain loop over candidate pairs, every cost computed."""
    import math

    from autoplan.planner.search.conversions import conversions, grad_spec, required_grad
    from autoplan.planner.search.costs import passes_partial

    mesh = kc_v.mesh
    out = {}
    for e in edges:
        src = kc_u.out_spec[e.u][(e.p, e.o)]
        _, dst, spl = kc_v.in_info[(e.m, e.q)]
        if (e.u, e.v) not in out:
            shape = (len(kc_u.cand[e.u]), len(kc_v.cand[e.v]))
            out[(e.u, e.v)] = (np.zeros(shape), np.zeros(shape))
        fm, bm = out[(e.u, e.v)]
        for i, s_spec in enumerate(src):
            k_i = kc_u.cand[e.u][i]
            passing = tuple(a for a in range(2) if passes_partial(kc_u.kg, e.p, k_i, a))
            for j, d_spec in enumerate(dst):
                if s_spec is None or d_spec is None:
                    fm[i, j] = bm[i, j] = math.inf
                    continue
                fm[i, j] += cm.conversion_time(conversions(s_spec, d_spec, mesh.shape),
                                               e.nbytes, mesh)
                g = grad_spec(d_spec, spl[j])
                convs = tuple(c for c in conversions(g, required_grad(s_spec), mesh.shape)
                              if not (g[c.axis] == "P" and (
                                  e.u in multi or e.p in kc_u.sinks or c.axis in passing)))
                bm[i, j] += cm.conversion_time(convs, e.nbytes, mesh)
    return out


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.label())
def test_edge_matrices_equal_the_loop_over_candidate_pairs(small, mesh):
    """Resharding matrices with costs shared by edges of the same bytes equal the
    pair-by-pair loop bit for bit, within each kind and across each transition, with and
    without producers whose Partial gradients are summed once."""
    from autoplan.planner.search.compose import transition_edges
    from autoplan.planner.search.costs import _edge_matrices

    problem, ms, ev = small
    cases = [(ev.kind_costs(k, mesh, 16), ev.kind_costs(k, mesh, 16), None)
             for k in ms.kinds]
    cases += [(ev.kind_costs(a, mesh, 16), ev.kind_costs(b, mesh, 16), (a, b))
              for a, b in ms.transitions]
    checked = 0
    for kc_u, kc_v, pair in cases:
        edges = kc_u.edges if pair is None else transition_edges(ms, pair, kc_u, kc_v)
        for multi in (set(), {e.u for e in edges[::2]}):
            got = _edge_matrices(ev.cm, kc_u, kc_v, edges, multi)
            want = _loop_edge_matrices(ev.cm, kc_u, kc_v, edges, multi)
            assert got.keys() == want.keys()
            for key in want:
                assert np.array_equal(got[key][0], want[key][0])
                assert np.array_equal(got[key][1], want[key][1])
                checked += 1
    assert checked > 10


def test_kept_rows_equal_direct_indexing(small):
    """packed.Kept (what kind_costs takes of the valid rows, kept per valid set) equals
    indexing the packed anchor's arrays and specs directly, for every valid set the
    micro-batches give and for a set leaving rows out."""
    problem, ms, ev = small
    cm = ev.cm
    mesh = LogicalMesh((4, 4), 8)
    for kind, kg in ms.kinds.items():
        for ai in range(len(kg.anchors)):
            pk = cm._packed(kg, mesh.shape, ms.exported(kind), ai)
            keeps = [pk.valid(mb / cm.b0) for mb in (64, 16, 2, 1)]
            keeps.append(np.arange(pk.n)[::2])
            for keep in keeps:
                got = pk.kept(ai, keep)
                assert got is pk.kept(ai, keep.copy())         # kept per valid set
                assert np.array_equal(got.cand, pk.ks[keep])
                assert np.array_equal(got.psi, pk.pvec[keep])
                assert np.array_equal(got.gathered, pk.gbytes[keep])
                assert np.array_equal(got.tp_matmuls, pk.tp_matmuls[keep])
                rows = set(keep.tolist())
                for key, (rs, vals) in pk.o_specs.items():
                    assert got.out_specs[key] == [v for r, v in zip(rs.tolist(), vals)
                                                  if r in rows]
                for key, (rs, vals) in pk.i_specs.items():
                    pairs = [v for r, v in zip(rs.tolist(), vals) if r in rows]
                    assert got.in_info[key] == (ai, [v[0] for v in pairs],
                                                [v[1] for v in pairs])


def test_shared_rows_equal_priced_rows_per_caller(small):
    """SharedRows prices a mesh once over the stage DP's ranges and the balanced chunks:
    each caller's columns equal priced_rows over its own ranges, bit for bit; ranges
    nobody announced are priced on their own."""
    from autoplan.planner.search.search import _Workspace, layer_units
    from autoplan.planner.search.library import build_library
    from autoplan.planner.search.tables import SharedRows, priced_rows

    problem, ms, ev = small
    lib = build_library(ev, ms, problem.cluster.world_size, 64)
    ws = _Workspace(ev, lib)
    mesh, mb, m = LogicalMesh((4, 4), 8), 16, 4
    kinds = list(dict.fromkeys(ms.layer_kind))
    kt = {k: ws.kind_table(k, mesh, mb) for k in kinds}
    combos = Combos([(lam, z, ck) for lam in (0.0, 1e-10) for z in (0, 2, 3)
                     for ck in (False, True)] + [(c, 1, False) for c in lib.coherent()])
    arrays = ws.layer_arrays(mb)
    units = layer_units(ms, 32)
    ui, uj = np.triu_indices(len(units), k=1)
    a_dp, b_dp = np.array(units)[ui], np.array(units)[uj]
    a_bal, b_bal = np.array([0, 2, 4]), np.array([2, 4, len(ms.layer_kind)])
    shared = SharedRows(ev, mb, m, combos, arrays, {mesh.size: (a_bal, b_bal)})
    a_new, b_new = np.array([1]), np.array([3])
    for a, b in ((a_dp, b_dp), (a_bal, b_bal), (a_new, b_new)):
        rows, rc, picks = shared(mesh, kt, a, b)
        want_rows, want, want_picks = priced_rows(ev, mesh, mb, m, kt, combos, arrays, a, b)
        assert rows == want_rows and picks == want_picks
        for field in ("t", "u", "states", "act", "fixed", "send"):
            assert np.array_equal(getattr(rc, field), getattr(want, field)), field


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.label())
def test_replayed_transition_times_equal_the_direct_ones(small, mesh):
    """transition_time replays a transition's recorded bucket additions with each
    micro-batch's bytes: equal to pricing transition_buckets directly, at three
    micro-batches (the second and third replaying the first's records)."""
    problem, ms, ev = small
    for micro_batch in (64, 16, 4):
        for ka, kb in ms.transitions:
            kc_a = ev.kind_costs(ka, mesh, micro_batch)
            kc_b = ev.kind_costs(kb, mesh, micro_batch)
            rng = np.random.default_rng(micro_batch)
            for _ in range(6):
                ca = tuple(int(rng.integers(len(c))) for c in kc_a.cand)
                cb = tuple(int(rng.integers(len(c))) for c in kc_b.cand)
                tf, tb, _ = ev.transition_buckets(ka, kb, mesh, micro_batch, ca, cb)
                assert ev.transition_time(ka, kb, mesh, micro_batch, ca, cb) == \
                    (ev._time(tf, mesh), ev._time(tb, mesh))


def test_cached_shards_equal_the_direct_products():
    """costs._shards (cached) gives each sharded dim, in the set's order, with the product
    of the sizes of the axes sharding it, as the structure computed it in place."""
    import math

    from autoplan.placement import shard_dim
    from autoplan.planner.search.costs import _shards

    from autoplan.planner.search.strategies import basic_specs

    for spec in basic_specs(4, partial=True):
        for sizes in ((1, 8), (2, 4), (8, 1), (4, 4), (64, 8)):
            want = tuple((d, math.prod(sizes[x] for x in range(2) if shard_dim(spec[x]) == d))
                         for d in {shard_dim(p) for p in spec if p.startswith("S")})
            assert _shards(spec, sizes) == want


def test_sparse_table_range_maxima():
    rng = np.random.default_rng(5)
    x = rng.random((3, 13))
    table = _sparse_table(x)
    for a in range(13):
        for b in range(a + 1, 14):
            k = int(np.floor(np.log2(b - a)))
            got = np.maximum(table[:, k, a], table[:, k, b - (1 << k)])
            assert np.array_equal(got, x[:, a:b].max(axis=1))


def test_stage_dp_skipping_unusable_rows_matches_brute_force():
    """The DP restricted to the units where later stages can start and to the (position,
    size) pairs under t_max: the brute-force optimum, and the same F with ``lows`` given."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        t, v, m = random_stage_table(rng, 0.6)
        exact = brute_force(t, v, m)
        got = pipeline_dp(t, v, m, max_candidates=10 ** 6)
        assert (got is None) == (exact is None)
        if got is not None:
            assert got.latency == pytest.approx(exact.latency, rel=1e-12)
        finite = t[np.isfinite(t)]
        if finite.size:
            t_max = float(np.median(finite))
            assert np.array_equal(stage_dp(t, v, t_max),
                                  stage_dp(t, v, t_max, t.min(axis=(1, 2))))


def test_integral_lp_relaxation_gives_the_branch_and_bound_optimum(small):
    """The LP relaxation's integral optimum (intra_op._relaxation) has the objective CBC's
    branch and bound finds, on the whole model's ILP on three meshes at every library
    memory weight, with and without a memory budget, and on random instances (some
    fractional at the root: those fall back to CBC with the columns ruled out by reduced
    costs fixed at 0, which keeps the optimum)."""
    import math

    from autoplan.planner.search.intra_op import IlpBuilder, _relaxation
    from test_search import _random_problem

    problem, ms, ev = small
    comp = Composition.of(ms, 0, len(problem.graph.layers))
    integral = 0
    for mesh in MESHES:
        costs = {k: ev.kind_costs(k, mesh, 16) for k, _ in comp.counts}
        free, _ = build_problem(ev.cm, ms, comp, mesh, 16, micro_batches=4, in_flight=1,
                                checkpoint=False, costs=costs)
        least = solve(free, relaxation_first=False).memory
        for budget in (math.inf, 1.2 * least):
            ilp, _ = build_problem(ev.cm, ms, comp, mesh, 16, micro_batches=4, in_flight=1,
                                   checkpoint=False, costs=costs, budget=budget)
            weights = [ilp_weight(w) for w in LAMBDAS]
            fast = list(solve_weights(ilp, weights, time_limit_s=lambda: 30.0))
            slow = list(solve_weights(ilp, weights, time_limit_s=lambda: 30.0,
                                      relaxation_first=False))
            for w, a, b in zip(weights, fast, slow):
                assert a.objective == pytest.approx(b.objective, rel=1e-9, abs=1e-12)
                assert a.memory <= budget * (1 + 1e-9)
                at = ilp.__class__(**{**ilp.__dict__, "mem_weight": w})
                builder = IlpBuilder(at)
                builder.build()
                integral += _relaxation(builder, at, 30.0)[0] is not None
    assert integral >= 9                  # the fast path ran (most of the 18 are integral)
    rng = np.random.default_rng(7)
    fixing = 0
    for _ in range(60):
        ilp = _random_problem(rng)
        try:
            want = solve(ilp, relaxation_first=False, explain=False)
        except Exception as exc:          # infeasible: so is the relaxation-first solve
            with pytest.raises(type(exc)):
                solve(ilp, explain=False)
            continue
        got = solve(ilp, explain=False)
        assert got.objective == pytest.approx(want.objective, rel=1e-6, abs=1e-9)
        assert got.memory <= ilp.budget * (1 + 1e-9)
        builder = IlpBuilder(ilp)
        builder.build()
        fixing += bool(_relaxation(builder, ilp, 30.0)[1])
    assert fixing >= 3                    # fractional roots with columns fixed at 0


def test_an_lp_relaxation_stopped_by_its_time_limit_ends_the_solve(monkeypatch):
    """CLP stopped at its limit: the solve gives up (OutOfTime, an InfeasibleError) instead
    of handing branch and bound the same LP, which CBC would solve at its root without
    looking at its own limit; solve_weights yields None for it, as for an infeasible one."""
    from ortools.linear_solver import pywraplp

    from autoplan.planner.search.intra_op import OutOfTime
    from test_search import _random_problem

    real = pywraplp.Solver.CreateSolver

    class Stopped:
        def __init__(self, solver):
            self._s = solver

        def __getattr__(self, name):
            return getattr(self._s, name)

        def Solve(self):                            # noqa: N802 -- OR-Tools' name
            return pywraplp.Solver.FEASIBLE          # what CLP returns at its time limit

    monkeypatch.setattr(pywraplp.Solver, "CreateSolver", staticmethod(
        lambda name: Stopped(real(name)) if name == "CLP" else real(name)))
    ilp = _random_problem(np.random.default_rng(3))
    with pytest.raises(OutOfTime, match="did not finish in 2.0 s"):
        solve(ilp, explain=False, time_limit_s=2.0)
    assert list(solve_weights(ilp, [0.0, 1e-9], time_limit_s=lambda: 2.0)) == [None, None]


def test_dtensor_answers_shared_by_ops_alike_equal_asking_each(monkeypatch):
    """analyse asks DTensor once per strategy_key (ops alike: a block's layer norms, its
    residual adds); every op's strategies equal those of asking for each op, on a GPT
    with eager attention, whose strided shards take a second round of questions."""
    import autoplan.planner.search.compose as compose
    from autoplan.planner.search.kinds import build_kind
    from autoplan.planner.search.strategies import strategy_key

    problem = prepare(resolve("gpt", attention="eager", **GPT_SMALL), "dgx-a100",
                      global_batch=64, nodes=2)
    shared = analyse(problem.spec, problem.graph)
    monkeypatch.setattr(compose, "build_kind",
                        lambda mesh, graph, rec, layer, memo=None:
                        build_kind(mesh, graph, rec, layer, None))
    plain = analyse(problem.spec, problem.graph)
    assert plain.kinds.keys() == shared.kinds.keys()
    for kind, kg in shared.kinds.items():
        assert [(o.name, o.strategies) for o in kg.ops] == \
            [(o.name, o.strategies) for o in plain.kinds[kind].ops]
    assert any("~" in p for kg in shared.kinds.values() for o in kg.ops
               for s in o.strategies for spec in s.inputs for p in spec)   # strided ran
    ops = [op for layer_ops in record_ops(problem) for op in layer_ops]
    assert len({strategy_key(op) for op in ops}) < len(ops)     # some ops are alike


def record_ops(problem):
    from autoplan.planner.search.record import record_layers

    layers = sorted({layer.index for layer in problem.graph.layers[:3]})
    return record_layers(problem.spec, problem.graph, layers).ops.values()


def test_balanced_screen_holds_interleaved_chunks_as_the_schedule_does():
    """The balanced pipelines' memory screen weights an interleaved rank's chunks as the
    schedule holds them (the exact pricing's in_flight_weighted), not as v equal parts: with
    a heavy first chunk (an embedding), a budget between the two figures is refused."""
    from types import SimpleNamespace

    from autoplan.cost.memory import in_flight_micro_batches, in_flight_weighted
    from autoplan.planner.search.search import _balanced_latency, _in_flight

    pp, v, m = 2, 2, 4
    grid = np.arange(pp * v).reshape(v, pp)     # chunk c on rank c % pp
    act = np.array([[8.0, 1.0, 1.0, 1.0]])      # rank 0's first chunk holds the most
    rc = SimpleNamespace(states=np.zeros((1, 4)), act=act, fixed=np.zeros((1, 4)),
                         t=np.ones((1, 4)), send=np.zeros(4), u=np.zeros((1, 4)))
    chunks = [act[0, 0], act[0, 2]]             # rank 0's chunks in order
    exact = in_flight_weighted("interleaved_1f1b", pp, 0, m, v, chunks) * sum(chunks)
    flat = in_flight_micro_batches("interleaved_1f1b", pp, 0, m, v) * sum(chunks)
    assert exact > flat                         # the heavy chunk is held more often
    flight = _in_flight("interleaved_1f1b", pp, m, v)
    for budget, fits in ((exact, True), ((exact + flat) / 2, False)):
        lat, _ = _balanced_latency(rc, grid, v, m, flight, budget)
        assert np.isfinite(lat[0]) == fits
    one = _in_flight("1f1b", pp, m, 1)          # one chunk a rank: the closed form
    assert one.tolist() == [in_flight_micro_batches("1f1b", pp, d, m) for d in range(pp)]
