"""From a traced model to ILP instances: layer kinds, transitions, stage compositions.

:func:`analyse` does the mesh-independent work once per model: re-run the model to record
op arguments (:mod:`autoplan.planner.search.record`), enumerate DTensor strategies for one
layer of each *kind* (:mod:`autoplan.planner.search.strategies`, grouped by
:mod:`autoplan.planner.search.kinds`), and find the tensors that cross from one layer to the
next (*transitions*, e.g. block -> block: the residual stream).

:func:`build_problem` turns a *stage composition* — which layers a stage holds, on which
logical mesh, at which micro-batch — into an
:class:`~autoplan.planner.search.intra_op.IntraOpProblem`.
Identical layers (the same ``kind``) share one set of variables: every cost of a kind is
multiplied by its number of layers, every cost of a transition by its number of occurrences
(Alpa's and autoparallel's clustering of repeated layers), so a 96-layer GPT stage has the
variables of one block plus the embedding and the head.

Per group (anchor op) v of kind K with n_K layers in the stage, m micro-batches, s of them in
flight (:func:`~autoplan.cost.memory.in_flight_micro_batches`):

    c_v  = m n_K (t_fwd + t_bwd [+ t_fwd if K is a recomputed block])
    m_v  = s n_K act                      (0 for recomputed blocks: only their input stays,
                                           charged to the producer of that input)
    Z_v[z] = n_K optimizer_time(psi / D^{[z>=1]})
    M_v[z] = n_K sum_buckets psi_b (p / D_b^{[z=3]} + g / D_b^{[z>=2]} + o / D_b^{[z>=1]})

with (p, g, o) the bytes per parameter of the precision (mixed: 2, 2, 12) and D_b the size
of bucket b's sync group. Edge costs: m n (forward + backward resharding [+ forward again
if recomputed]). Hinges: the gradient all-reduce (per step) against the last micro-batch's
backward, and under ZeRO-3 the two parameter all-gathers (per micro-batch) against its
compute.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from autoplan.graph import OpGraph
from autoplan.planner.search.costs import (BUCKETS, CostModel, KindCosts, TensorEdge,
                                    edge_matrices, grad_spec, required_grad)
from autoplan.cost.step import OVERLAP_COST, REDUCE_BYTES
from autoplan.planner.search.intra_op import (ZERO_STAGES, Hinge, IntraOpProblem, Linear,
                                       PartialGroup)
from autoplan.planner.search.mesh import LogicalMesh
from autoplan.planner.search.kinds import KindGraph, build_kind
from autoplan.planner.search.strategies import Spec, probe_mesh

Transition = tuple[int, int, int, int]      # (producer pos, output, consumer pos, slot)


@dataclass
class ModelStructure:
    """Mesh-independent analysis of a traced model (module docstring)."""

    graph: OpGraph
    kinds: dict[str, KindGraph]
    layer_kind: list[str]
    transitions: dict[tuple[str, str], list[Transition]]
    is_block: list[bool]
    seconds: float = 0.0

    @functools.cached_property
    def layer_index(self) -> tuple[list[str], np.ndarray, list[tuple[str, str]], np.ndarray,
                                   np.ndarray]:
        """(kinds in order of first use, each layer's index into them, the distinct (kind,
        next kind) pairs, each layer boundary l = 1 .. L - 1's index into them, is_block as
        an array): what per-layer arrays are gathered by (:func:`.tables.layer_arrays`)."""
        order = list(dict.fromkeys(self.layer_kind))
        of = {k: i for i, k in enumerate(order)}
        kidx = np.array([of[k] for k in self.layer_kind], dtype=np.int64)
        pair_of: dict[tuple[str, str], int] = {}
        pidx = [pair_of.setdefault((a, b), len(pair_of))
                for a, b in zip(self.layer_kind, self.layer_kind[1:])]
        return (order, kidx, list(pair_of), np.array(pidx, dtype=np.int64),
                np.array(self.is_block, dtype=bool))

    def exported(self, kind: str) -> frozenset[int]:
        """Ops of ``kind`` whose outputs the next layer reads."""
        return frozenset(p for (ka, _), edges in self.transitions.items() if ka == kind
                         for p, _, _, _ in edges)

    def kind_costs(self, cm: CostModel, kind: str, mesh: LogicalMesh, micro_batch: int
                   ) -> KindCosts:
        return cm.kind_costs(self.kinds[kind], mesh, micro_batch,
                             exported=self.exported(kind))

    def imported(self, kind_prev: str, kind: str, kc_a: KindCosts, kc_b: KindCosts
                 ) -> list[tuple[int, float, list]]:
        """Saved bytes of the tensors a layer of ``kind`` reads from the previous layer (it
        keeps them for backward): (consumer anchor, bytes at the micro-batch, consumer's
        placement per candidate), one entry per tensor."""
        scale_b = kc_b.micro_batch / self.graph.batch.batch_size
        names_a = self.graph.layers[kc_a.kg.layer].nodes
        out, seen = [], set()
        for e in transition_edges(self, (kind_prev, kind), kc_a, kc_b):
            if (e.p, e.o) in seen:
                continue
            seen.add((e.p, e.o))
            node = self.graph.nodes[names_a[e.p]]
            if not node.saved_bytes:
                continue
            batchy = tuple(kc_a.kg.ops[e.p].output_shapes[0]) != \
                tuple(node.output_meta[0].shape)
            out.append((e.v, node.saved_bytes * (scale_b if batchy else 1.0),
                        kc_b.in_info[(e.m, e.q)][1]))
        return out

    def uncovered(self) -> list[tuple[str, str, str, str]]:
        """(kind, op name, aten op, why) of ops planned replicated for lack of a strategy."""
        return [(k, op.name, op.op, op.note) for k, kg in self.kinds.items()
                for op in kg.ops if not op.covered]


def analyse(spec, graph: OpGraph) -> ModelStructure:
    """Record, enumerate strategies and find transitions (module docstring)."""
    from autoplan.planner.search.record import record_layers

    t0 = time.perf_counter()
    kinds_order: list[str] = []
    rep: dict[str, int] = {}
    for layer in graph.layers:
        if layer.kind not in rep:
            rep[layer.kind] = layer.index
            kinds_order.append(layer.kind)
    trans_layer: dict[tuple[str, str], int] = {}
    for l in range(1, len(graph.layers)):
        key = (graph.layers[l - 1].kind, graph.layers[l].kind)
        trans_layer.setdefault(key, l)
    wanted = sorted(set(rep.values()) | set(trans_layer.values()))
    rec = record_layers(spec, graph, wanted)
    with probe_mesh() as mesh:
        memo: dict = {}                   # DTensor's answers for ops alike, on this mesh
        kinds = {k: build_kind(mesh, graph, rec, rep[k], memo) for k in kinds_order}
    transitions: dict[tuple[str, str], list[Transition]] = {}
    for key, l in trans_layer.items():
        prev_names = graph.layers[l - 1].nodes
        names = graph.layers[l].nodes
        prev_pos = {n: k for k, n in enumerate(prev_names)}
        node_names = list(graph.nodes)
        pos = {n: k for k, n in enumerate(names)}
        out: list[Transition] = []
        from autoplan.planner.search.kinds import flat_refs

        for op in rec.ops[l]:
            for q, r in enumerate(flat_refs(op)):
                if r.kind != "op":
                    continue
                src = node_names[r.source]
                if src in prev_pos:
                    out.append((prev_pos[src], r.output, pos[op.name], q))
        transitions[key] = out
    is_block = [not layer.name.startswith("<") for layer in graph.layers]
    return ModelStructure(graph, kinds, [l.kind for l in graph.layers], transitions, is_block,
                          time.perf_counter() - t0)


@dataclass(frozen=True)
class Composition:
    """Which layers a stage holds, counted by kind and by consecutive-kind pairs."""

    start: int
    end: int
    counts: tuple[tuple[str, int], ...]
    pairs: tuple[tuple[tuple[str, str], int], ...]
    blocks: tuple[str, ...]                  # kinds that are repeated blocks

    @classmethod
    def of(cls, ms: ModelStructure, start: int, end: int) -> "Composition":
        counts = Counter(ms.layer_kind[start:end])
        pairs = Counter((ms.layer_kind[l - 1], ms.layer_kind[l]) for l in range(start + 1, end))
        blocks = tuple(sorted({ms.layer_kind[l] for l in range(start, end) if ms.is_block[l]}))
        order = list(dict.fromkeys(ms.layer_kind[start:end]))
        return cls(start, end, tuple((k, counts[k]) for k in order),
                   tuple(sorted(pairs.items())), blocks)


@dataclass
class Decode:
    """Which ILP group is which (kind, anchor index)."""

    groups: list[tuple[str, int]]
    offset: dict[str, int]
    costs: dict[str, KindCosts]


def transition_edges(ms: ModelStructure, key: tuple[str, str], kc_a: KindCosts,
                     kc_b: KindCosts) -> list[TensorEdge]:
    """TensorEdges of a transition between the costs of its two kinds."""
    scale_b = kc_b.micro_batch / ms.graph.batch.batch_size
    names_b = ms.graph.layers[kc_b.kg.layer].nodes
    out = []
    idx_a = {a: i for i, a in enumerate(kc_a.anchors)}
    idx_b = {a: i for i, a in enumerate(kc_b.anchors)}
    for p, o, m, q in ms.transitions.get(key, []):
        kg_a, kg_b = kc_a.kg, kc_b.kg
        if p in kg_a.param_chain or m in kg_b.param_chain:
            continue
        u = idx_a.get(kg_a.anchor_of[p])
        v = idx_b.get(kg_b.anchor_of[m])
        if u is None or v is None or q >= len(kg_b.ops[m].input_shapes):
            continue
        meta = ms.graph.nodes[names_b[m]].input_meta[q]
        scaled = tuple(kg_b.ops[m].input_shapes[q]) != tuple(meta.shape)
        out.append(TensorEdge(u, p, o, v, m, q, meta.nbytes * (scale_b if scaled else 1.0)))
    return out


def build_problem(cm: CostModel, ms: ModelStructure, comp: Composition, mesh: LogicalMesh,
                  micro_batch: int, *, micro_batches: int, in_flight: float,
                  checkpoint: bool, budget: float = math.inf, mem_weight: float = 0.0,
                  zero_allowed: tuple[int, ...] = (0, 1, 2, 3),
                  costs: dict[str, KindCosts] | None = None,
                  restrict: dict[str, list[np.ndarray]] | None = None
                  ) -> tuple[IntraOpProblem, Decode]:
    """The ILP of one stage composition (module docstring). ``restrict``: per kind and
    anchor, the candidate indices allowed (others get no variable)."""
    costs = dict(costs or {})
    for kind, _ in comp.counts:
        if kind not in costs:
            costs[kind] = ms.kind_costs(cm, kind, mesh, micro_batch)
    m = micro_batches
    names: list[str] = []
    node_cost: list[np.ndarray] = []
    node_mem: list[np.ndarray] = []
    groups: list[tuple[str, int]] = []
    offset: dict[str, int] = {}
    keep: dict[str, list[np.ndarray]] = {}
    for kind, n in comp.counts:
        kc = costs[kind]
        offset[kind] = len(groups)
        recompute = checkpoint and kind in comp.blocks
        keep[kind] = []
        for ai, a in enumerate(kc.anchors):
            sel = (restrict or {}).get(kind, [None] * len(kc.anchors))[ai]
            sel = np.arange(len(kc.cand[ai])) if sel is None else np.asarray(sel)
            keep[kind].append(sel)
            f = kc.fwd[ai][sel] + kc.comm_fwd[ai][sel]
            b = kc.bwd[ai][sel] + kc.comm_bwd[ai][sel]
            node_cost.append(m * n * (f + b + (f if recompute else 0.0)))
            node_mem.append(0.0 * f if recompute else in_flight * n * kc.act[ai][sel])
            names.append(f"{kind}:{kc.kg.ops[a].name}")
            groups.append((kind, ai))
    gid = lambda kind, ai: offset[kind] + ai               # noqa: E731
    problem = IntraOpProblem(names, node_cost, node_mem, [], budget=budget,
                             mem_weight=mem_weight, zero_allowed=zero_allowed)
    edge_index: dict[tuple[int, int], int] = {}

    def add_edges(kc_a: KindCosts, kc_b: KindCosts, ka: str, kb: str, edges, count: float,
                  multi: set) -> None:
        recompute = checkpoint and kb in comp.blocks
        for (u, v), (fm, bm) in edge_matrices(cm, kc_a, kc_b, edges, multi).items():
            su, sv = keep[ka][u], keep[kb][v]
            cost = m * count * (fm + bm + (fm if recompute else 0.0))[np.ix_(su, sv)]
            key = (gid(ka, u), gid(kb, v))
            if key in edge_index:
                k = edge_index[key]
                problem.edges[k] = (key[0], key[1], problem.edges[k][2] + cost)
            else:
                edge_index[key] = len(problem.edges)
                problem.edges.append((key[0], key[1], cost))

    # edges inside each kind; Partial gradients into a group read by several groups: once
    for kind, n in comp.counts:
        kc = costs[kind]
        readers = Counter(e.u for e in kc.edges)
        multi = {u for u, c in readers.items() if c > 1}
        add_edges(kc, kc, kind, kind, kc.edges, n, multi)
        _add_partial_groups(problem, cm, kc, keep[kind], multi, m * n, edge_index,
                            lambda ai, kind=kind: gid(kind, ai))
    # edges between consecutive layers inside the stage
    for (ka, kb), count in comp.pairs:
        kc_a, kc_b = costs[ka], costs[kb]
        edges = transition_edges(ms, (ka, kb), kc_a, kc_b)
        add_edges(kc_a, kc_b, ka, kb, edges, count, set())
        if checkpoint and kb in comp.blocks:       # a recomputed block keeps its input
            for e in {(e.u, e.p, e.o): e for e in edges}.values():
                spec = kc_a.out_spec[e.u][(e.p, e.o)]
                sel = keep[ka][e.u]
                kept = np.array([e.nbytes / _shard(spec[j], mesh) if spec[j] else e.nbytes
                                 for j in sel])
                layers_in = dict(comp.counts)[kb]
                problem.node_mem[gid(ka, e.u)] = problem.node_mem[gid(ka, e.u)] + \
                    in_flight * layers_in / max(1, _incoming(comp, kb)) * count * kept
    # a layer keeps the input it read from the previous layer (unless recomputed: then
    # only that, charged above); one per layer of the kind, as its consumers place it
    for kind, n in comp.counts:
        first = comp.start if ms.layer_kind[comp.start] == kind else None
        prev = {ka for (ka, kb) in ms.transitions if kb == kind}
        if (checkpoint and kind in comp.blocks) or not prev:
            continue
        ka = next((k for k, _ in comp.pairs if k[1] == kind), (sorted(prev)[0], kind))[0]
        kc_a = costs.get(ka) or ms.kind_costs(cm, ka, mesh, micro_batch)
        layers = n - (1 if first is not None and comp.start == 0 else 0)
        for v, nbytes, specs in ms.imported(ka, kind, kc_a, costs[kind]):
            sel = keep[kind][v]
            kept = np.array([nbytes / (_shard(specs[j], mesh) if specs[j] else 1)
                             for j in sel])
            problem.node_mem[gid(kind, v)] = problem.node_mem[gid(kind, v)] + \
                in_flight * layers * kept
    _add_parameters(problem, cm, comp, costs, keep, mesh, m, offset)
    _add_peaks(problem, comp, costs, keep, offset, checkpoint)
    return problem, Decode(groups, offset, {k: costs[k] for k, _ in comp.counts})


def _incoming(comp: Composition, kind: str) -> int:
    return sum(c for (_, kb), c in comp.pairs if kb == kind)


def _shard(spec: Spec, mesh: LogicalMesh) -> int:
    return math.prod(mesh.shape[a] for a in range(len(spec)) if spec[a].startswith("S"))


def _add_partial_groups(problem: IntraOpProblem, cm: CostModel, kc: KindCosts, keep,
                        multi: set, weight: float, edge_index, gid) -> None:
    mesh = kc.mesh
    for u in sorted(multi):
        readers = [e for e in kc.edges if e.u == u]
        src = kc.out_spec[u][(readers[0].p, readers[0].o)]
        su = keep[u]
        for axis in range(2):
            if mesh.shape[axis] == 1:
                continue
            cost = np.zeros(len(su))
            for k, i in enumerate(su):
                if src[i] is None:
                    continue
                r = required_grad(src[i])
                coll = "all_reduce" if r[axis] == "R" else "reduce_scatter"
                div = math.prod(mesh.shape[b] for b in range(2)
                                if b != axis and (r[b].startswith("S")))
                cost[k] = weight * cm.coll(coll, readers[0].nbytes / div, mesh.group((axis,)))
            pairs = []
            for e in readers:
                _, dst, spl = kc.in_info[(e.m, e.q)]
                sv = keep[e.v]
                mask = np.zeros((len(su), len(sv)), dtype=bool)
                for b_, j in enumerate(sv):
                    if dst[j] is not None and grad_spec(dst[j], spl[j])[axis] == "P":
                        mask[:, b_] = True
                key = (gid(e.u), gid(e.v))
                if key in edge_index and mask.any():
                    pairs.append((edge_index[key], mask))
            if pairs and cost.any():
                problem.partials.append(PartialGroup(gid(u), cost, pairs))


def zero_factors(psi: np.ndarray, mesh: LogicalMesh, state_bytes) -> np.ndarray:
    """(K, 4): bytes per device of the parameters ``psi`` (K x buckets) at ZeRO 0..3."""
    p_b, g_b, o_b = state_bytes
    out = np.zeros((psi.shape[0], ZERO_STAGES))
    for bi, axes in enumerate(BUCKETS):
        d = mesh.group(axes).size
        for z in range(ZERO_STAGES):
            per = (p_b / (d if z >= 3 else 1) + g_b / (d if z >= 2 else 1)
                   + o_b / (d if z >= 1 else 1))
            out[:, z] += psi[:, bi] * per
    return out


def _add_parameters(problem: IntraOpProblem, cm: CostModel, comp: Composition, costs, keep,
                    mesh: LogicalMesh, m: int, offset) -> None:
    sync_a, gather_a, bwd_b, mb_b = Linear(), Linear(), Linear(), Linear()
    ar = [_per_byte(cm, "all_reduce", mesh.group(axes)) for axes in BUCKETS]
    ag = [_per_byte(cm, "all_gather", mesh.group(axes)) for axes in BUCKETS]
    dsize = np.array([mesh.group(axes).size for axes in BUCKETS], dtype=float)
    for kind, n in comp.counts:
        kc = costs[kind]
        for ai in range(len(kc.anchors)):
            v = offset[kind] + ai
            sel = keep[kind][ai]
            psi = kc.psi[ai][sel]
            bwd_b.node[v] = n * kc.bwd[ai][sel]
            mb_b.node[v] = n * (kc.fwd[ai][sel] + kc.bwd[ai][sel])
            if not psi.any():
                continue
            problem.zmem[v] = n * zero_factors(psi, mesh, cm.state_bytes)
            opt = np.zeros((len(sel), ZERO_STAGES))
            for z in range(ZERO_STAGES):
                local = (psi / np.where(dsize > 0, dsize, 1) if z >= 1 else psi).sum(axis=1)
                opt[:, z] = [cm.compute.optimizer_time(x) for x in local]
            problem.zcost[v] = n * opt
            sync_a.node[v] = n * (psi * REDUCE_BYTES * np.array(ar)).sum(axis=1)
            g = np.zeros((len(sel), ZERO_STAGES))
            g[:, 3] = n * 2 * (psi * cm.param_bytes * np.array(ag)).sum(axis=1)
            gather_a.zpair[v] = g
    problem.hinges.append(Hinge(sync_a, bwd_b, OVERLAP_COST, 1.0))
    problem.hinges.append(Hinge(gather_a, mb_b, OVERLAP_COST, float(m)))


def _per_byte(cm: CostModel, collective: str, group) -> float:
    """Seconds per byte of a collective on ``group`` (the bandwidth term; latency left out
    of the ILP, kept by the evaluator)."""
    return cm.line(collective, group)[1]


def _add_peaks(problem: IntraOpProblem, comp: Composition, costs, keep, offset,
               checkpoint: bool) -> None:
    """ZeRO-3's two gathered layers, and a recomputed layer's activations: the largest."""
    gathered, peak = [], []
    for kind, _ in comp.counts:
        kc = costs[kind]
        lin_g, lin_p = Linear(), Linear()
        for ai in range(len(kc.anchors)):
            v = offset[kind] + ai
            sel = keep[kind][ai]
            g = np.zeros((len(sel), ZERO_STAGES))
            g[:, 3] = 2 * kc.gathered[ai][sel]
            lin_g.zpair[v] = g
            lin_p.node[v] = kc.act[ai][sel]
        gathered.append(lin_g)
        if checkpoint and kind in comp.blocks:
            peak.append(lin_p)
    problem.mem_max.append(gathered)
    if peak:
        problem.mem_max.append(peak)
