"""Predict the step time and memory of a searched plan — the uniform planner's composition,
stage by stage.

The search chooses, per pipeline stage, a layer range, a logical mesh, one placement per op
group of each layer kind, a ZeRO stage and recomputation (:class:`StageChoice`). This
module prices that choice with the same formulas as
:class:`~autoplan.planner.grid.estimate.Estimator` (its docstring has them), generalised from
"TP degree t" to per-op placements:

* per micro-batch, stage c: compute t_f(c), t_b(c) = the ops' ``op_time`` under their
  placements (:mod:`autoplan.planner.search.costs`); *layer communication* tp_f(c), tp_b(c) = the
  resharding the placements imply, forward and backward; send(c) = the stage's output
  activation split over its devices (Megatron's scatter/gather), to the next stage.
* Collectives of one kind along one mesh axis in one layer and direction are costed as one
  collective of their summed bytes — the Estimator's convention (``LayerStats.
  tp_allreduce_*_bytes`` is one all-reduce per layer), so a Megatron layout is priced
  exactly as the uniform planner prices it.
* each stage becomes a :class:`~autoplan.cost.step.ChunkCost` — its parameters in buckets
  by the mesh axes their gradients are summed over (one collective per bucket), its
  activations x micro-batches in flight, one recomputed layer's activations, the largest
  layer's gathered parameters (ZeRO-3) — and :class:`~autoplan.cost.step.StepModel`
  composes the step (pipeline latency, the data-parallel and optimizer terms, memory per
  device, ranks sharing CPU cores, calibration) exactly as for the grid: the formulas are in
  :mod:`autoplan.cost.step`.
* recomputation per stage: full (each block's input kept, its forward and in-layer
  communication run again), selective (the attention core's forward again, its matrices
  not kept) or op-level (:mod:`autoplan.cost.recompute`: the input, the attention outputs
  and every other matmul's output kept, as each op's placement shards them, and the
  reduce-scatters' outputs; the other ops' forward and the layer's other forward
  collectives run again -- :meth:`Evaluator.op_recompute`).

Two refinements over the Estimator, both only where a uniform plan never goes: ops on
tensors without a batch dimension (a causal mask) do not scale with the micro-batch, and a
Partial gradient reaching an op whose inputs need no gradient (a position embedding
broadcast over a sharded batch) is summed with the parameter gradients once per step
rather than per micro-batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from autoplan.cost.comm import Group
from autoplan.cost.memory import temporary_bytes
from autoplan.cost.recompute import core_fwd_flops
from autoplan.cost.step import ChunkCost, ParamBucket, StepModel, Workload
from autoplan.plan import Prediction
from autoplan.planner.search.compose import ModelStructure, transition_edges
from autoplan.planner.search.costs import (BUCKETS, CORE_ACT, CORE_FWD, GEMM_BWD, GEMM_FWD,
                                    OP_ACT, OP_FWD, CostModel, KindCosts, TensorEdge,
                                    conversions, grad_spec, passes_partial, required_grad)
from autoplan.planner.search.mesh import LogicalMesh

Buckets = dict[tuple[str, str, int], float]      # (direction, collective, axis) -> bytes


@dataclass(frozen=True)
class StageChoice:
    """One stage: layers [start, end) on ``mesh``; ``choice``: per kind, the candidate
    index (into that kind's :class:`KindCosts` arrays) of every anchor."""

    start: int
    end: int
    mesh: LogicalMesh
    choice: tuple[tuple[str, tuple[int, ...]], ...]
    zero: int = 0
    checkpoint: bool = False
    selective: bool = False        # selective recomputation (the attention core only)
    tp_overlap: bool = False       # TP collectives overlapped with their GEMMs
    op_level: bool = False         # op-level recomputation (torchtitan's per-op policy)

    @property
    def recompute(self) -> str:
        """The stage's recomputation mode, as ``parallel.checkpoint`` names it."""
        return "full" if self.checkpoint else "selective" if self.selective else \
            "op" if self.op_level else "none"

    def of(self, kind: str) -> tuple[int, ...]:
        return dict(self.choice)[kind]


@dataclass(frozen=True)
class PipelineChoice:
    """The whole plan: stages in order (chunk c runs on pipeline rank c % pp), the
    micro-batch B (samples, split over each stage's batch-sharding axes), its count m, the
    schedule and the model chunks per rank v."""

    stages: tuple[StageChoice, ...]
    micro_batch: int
    num_micro_batches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def pp(self) -> int:
        return len(self.stages) // self.virtual_stages

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.num_micro_batches


class Evaluator:
    """Prices :class:`PipelineChoice` objects for one (graph, cluster, precision)."""

    def __init__(self, cm: CostModel, ms: ModelStructure):
        self.cm = cm
        self.ms = ms
        self.graph = ms.graph
        self.b0 = ms.graph.batch.batch_size
        self._kc: dict[tuple[str, LogicalMesh, int], KindCosts] = {}
        self._trans: dict[tuple, tuple[float, float]] = {}
        self._edge_plans: dict[tuple, tuple[list, dict]] = {}
        self._psi: dict[tuple, np.ndarray] = {}    # tables._psi: (kind, mesh, strategies)
        self._transition_edges: dict[tuple[str, str, int], list[TensorEdge]] = {}
        self._trans_plans: dict[tuple, list] = {}  # transition_time's recorded additions
        self.output_bytes = np.array([l.stats.output_bytes for l in ms.graph.layers],
                                     dtype=float)
        prov = cm.provenance
        self.step = StepModel(cm.compute, cm.comm, precision=cm.precision,
                              memory_limit_bytes=cm.memory_limit_bytes,
                              peak_flops=cm.compute.peak,
                              shared=prov.composer if prov is not None else None,
                              calibration=cm.calibration)

    def kind_costs(self, kind: str, mesh: LogicalMesh, micro_batch: int) -> KindCosts:
        key = (kind, mesh, micro_batch)
        if key not in self._kc:
            self._kc[key] = self.ms.kind_costs(self.cm, kind, mesh, micro_batch)
        return self._kc[key]

    # ---- communication of one layer ------------------------------------------------------
    def _edge_buckets(self, kc_u: KindCosts, kc_v: KindCosts, edges: list[TensorEdge],
                      cu: tuple[int, ...], cv: tuple[int, ...], fwd: Buckets, bwd: Buckets,
                      moved: dict[int, tuple[int, ...]],
                      counts: dict | None = None, adds: list | None = None) -> None:
        """Add the collectives of ``edges`` under choices ``cu``/``cv``; Partial gradients
        into one producer group (a tensor and its views) summed once; Partial gradients into
        a sink deferred (``moved``: anchor of the sink -> extra sync axes). ``counts``
        (bucket -> collectives) counts a gradient summed once for several consumers once
        per consumer, as per-module DTensor issues them (:meth:`cpu_layer_time`). ``adds``
        (a list) records each bucket addition as (direction, bucket, edge index, divisor)."""
        shape = kc_v.mesh.shape
        done: set[tuple[int, int]] = set()
        tally = counts if counts is not None else {}
        for ei, e in enumerate(edges):
            src = kc_u.out_spec[e.u][(e.p, e.o)][cu[e.u]]
            _, dsts, spl = kc_v.in_info[(e.m, e.q)]
            dst, sp = dsts[cv[e.v]], spl[cv[e.v]]
            if src is None or dst is None:
                continue
            for c in conversions(src, dst, shape):
                key = ("fwd", c.collective, c.axis)
                fwd[key] = fwd.get(key, 0.0) + e.nbytes / c.divisor
                tally[key] = tally.get(key, 0) + 1
                if adds is not None:
                    adds.append(("fwd", key, ei, c.divisor))
            g, r = grad_spec(dst, sp), required_grad(src)
            for c in conversions(g, r, shape):
                key = ("bwd", c.collective, c.axis)
                if g[c.axis] == "P":
                    if passes_partial(kc_u.kg, e.p, kc_u.cand[e.u][cu[e.u]], c.axis):
                        continue                  # reduce-scattered by the gathering view
                    if e.p in kc_u.sinks:
                        moved[e.u] = tuple(sorted(set(moved.get(e.u, ())) | {c.axis}))
                        continue
                    tally[key] = tally.get(key, 0) + 1
                    if (e.u, c.axis) in done:      # views of one tensor: summed once
                        continue
                    done.add((e.u, c.axis))
                else:
                    tally[key] = tally.get(key, 0) + 1
                bwd[key] = bwd.get(key, 0.0) + e.nbytes / c.divisor
                if adds is not None:
                    adds.append(("bwd", key, ei, c.divisor))

    def layer_buckets(self, kind: str, mesh: LogicalMesh, micro_batch: int,
                      choice: tuple[int, ...], counts: dict | None = None
                      ) -> tuple[Buckets, Buckets, dict]:
        kc = self.kind_costs(kind, mesh, micro_batch)
        fwd: Buckets = {}
        bwd: Buckets = {}
        for ai, j in enumerate(choice):
            for d, coll, axis, nbytes in kc.internal[ai][j]:
                target = fwd if d == "fwd" else bwd
                target[(d, coll, axis)] = target.get((d, coll, axis), 0.0) + nbytes
                if counts is not None:
                    counts[(d, coll, axis)] = counts.get((d, coll, axis), 0) + 1
        moved: dict[int, tuple[int, ...]] = {}
        if counts is not None:
            self._edge_buckets(kc, kc, kc.edges, choice, choice, fwd, bwd, moved, counts)
            return fwd, bwd, moved
        # the layer's edges do the same collectives at every micro-batch, only their bytes
        # scale: their sequence of bucket additions is kept per (kind, mesh, strategies)
        # and replayed with this micro-batch's bytes, term for term
        strategies = tuple(int(kc.cand[ai][j]) for ai, j in enumerate(choice))
        key = (kind, mesh, strategies)
        plan = self._edge_plans.get(key)
        if plan is None:
            plan = self._edge_plans[key] = _record_edge_plan(self, kc, choice)
        adds, moved_plan = plan
        for d, bucket, e, div in adds:
            target = fwd if d == "fwd" else bwd
            target[bucket] = target.get(bucket, 0.0) + kc.edges[e].nbytes / div
        moved.update(moved_plan)
        return fwd, bwd, moved

    def transition_buckets(self, ka: str, kb: str, mesh: LogicalMesh, micro_batch: int,
                           ca: tuple[int, ...], cb: tuple[int, ...],
                           counts: dict | None = None) -> tuple[Buckets, Buckets, dict]:
        kc_a = self.kind_costs(ka, mesh, micro_batch)
        kc_b = self.kind_costs(kb, mesh, micro_batch)
        fwd: Buckets = {}
        bwd: Buckets = {}
        moved: dict[int, tuple[int, ...]] = {}
        self._edge_buckets(kc_a, kc_b, transition_edges(self.ms, (ka, kb), kc_a, kc_b),
                           ca, cb, fwd, bwd, moved, counts)
        return fwd, bwd, moved

    def transition_time(self, ka: str, kb: str, mesh: LogicalMesh, micro_batch: int,
                        ca: tuple[int, ...], cb: tuple[int, ...]) -> tuple[float, float]:
        """(forward, backward) seconds of the transition's collectives on their own.

        The transition does the same collectives at every micro-batch, only their bytes
        scale: its sequence of bucket additions is kept per (kinds, mesh, strategies) and
        replayed with this micro-batch's edges (as :meth:`layer_buckets` replays a layer's),
        term for term what :meth:`transition_buckets` adds."""
        key = (ka, kb, mesh, micro_batch, ca, cb)
        hit = self._trans.get(key)
        if hit is None:
            kc_a = self.kind_costs(ka, mesh, micro_batch)
            kc_b = self.kind_costs(kb, mesh, micro_batch)
            edges = self._transition_edges.get((ka, kb, micro_batch))
            if edges is None:      # the same on every mesh (anchors and bytes only)
                edges = self._transition_edges[(ka, kb, micro_batch)] = transition_edges(
                    self.ms, (ka, kb), kc_a, kc_b)
            strategies = (tuple(int(kc_a.cand[i][j]) for i, j in enumerate(ca)),
                          tuple(int(kc_b.cand[i][j]) for i, j in enumerate(cb)))
            plan_key = (ka, kb, mesh, strategies)
            adds = self._trans_plans.get(plan_key)
            if adds is None:
                adds = []
                self._edge_buckets(kc_a, kc_b, edges, ca, cb, {}, {}, {}, adds=adds)
                self._trans_plans[plan_key] = adds
            fwd: Buckets = {}
            bwd: Buckets = {}
            for d, bucket, e, div in adds:
                target = fwd if d == "fwd" else bwd
                target[bucket] = target.get(bucket, 0.0) + edges[e].nbytes / div
            hit = self._trans[key] = (self._time(fwd, mesh), self._time(bwd, mesh))
        return hit

    def _time(self, buckets: Buckets, mesh: LogicalMesh) -> float:
        return sum(self.cm.coll(coll, nbytes, mesh.group((axis,)))
                   for (_, coll, axis), nbytes in sorted(buckets.items()))

    def op_recompute(self, fwd: Buckets, mesh: LogicalMesh, total: float | None = None
                     ) -> tuple[float, float]:
        """(seconds, bytes) of a layer's forward collectives ``fwd`` under op-level
        recomputation (:mod:`autoplan.cost.recompute`): the policy keeps the outputs of the
        reduce-scatters (sequence parallelism; 1/n of each message on each of the n ranks)
        and runs the other collectives again in backward (the all-gathers before column
        matmuls; the all-reduces of row matmuls without sequence parallelism). ``total``:
        ``_time(fwd)``, if the caller has it (all of it, where nothing is reduce-scattered)."""
        if total is not None and not any(k[1] == "reduce_scatter" for k in fwd):
            return total, 0.0
        again = {k: v for k, v in fwd.items() if k[1] != "reduce_scatter"}
        kept = sum(v / mesh.shape[k[2]] for k, v in sorted(fwd.items())
                   if k[1] == "reduce_scatter")
        return self._time(again, mesh), float(kept)

    # ---- ranks sharing CPU cores ---------------------------------------------------------
    @property
    def composer(self):
        """The step's :class:`~autoplan.cost.shared_cores.SharedCores` property when the
        cluster's ranks share CPU cores (None otherwise)."""
        return self.step.shared

    def cpu_layer_time(self, buckets: Buckets, counts: dict, mesh: LogicalMesh,
                       tp_matmuls: int) -> float:
        """One direction of a layer's communication on shared cores, as
        :mod:`autoplan.cost.shared_cores` counts the engine's DTensor TP: each bucket's
        bytes in as many collectives as consumers issue them, and DTensor's per-module work
        (half of ``tp_matmul_overhead_s`` per sharded matmul and direction, at the share)."""
        comp = self.composer
        t = comp.matmul_overhead(tp_matmuls)
        for key, nbytes in sorted(buckets.items()):
            if nbytes <= 0:
                continue
            _, coll, axis = key
            t += comp.split_time(self.cm.comm, coll, nbytes, counts.get(key, 1),
                                 mesh.group((axis,)))
        return t

    # ---- one stage -------------------------------------------------------------------------
    def stage_cost(self, st: StageChoice, micro_batch: int, *, last: bool,
                   cross_node: bool) -> ChunkCost:
        """The stage's :class:`~autoplan.cost.step.ChunkCost` (per micro-batch ``micro_batch``
        of the whole stage)."""
        return self._stage_cost(st, micro_batch, last, cross_node)

    @functools.lru_cache(maxsize=4096)
    def _stage_cost(self, st: StageChoice, micro_batch: int, last: bool,
                    cross_node: bool) -> ChunkCost:
        ms, mesh = self.ms, st.mesh
        fwd = bwd = tp_f = tp_b = act = peak = gathered = core = gemm_f = gemm_b = 0.0
        psi = np.zeros(len(BUCKETS))
        comm_cache: dict[tuple[str, str | None], tuple] = {}
        composer = self.composer
        cpu_f = cpu_b = 0.0
        for l in range(st.start, st.end):
            kind = ms.layer_kind[l]
            prev = ms.layer_kind[l - 1] if l > st.start else None
            kc = self.kind_costs(kind, mesh, micro_batch)
            ch = st.of(kind)
            key = (kind, prev)
            if key not in comm_cache:
                counts: dict | None = {} if composer is not None else None
                f_b, b_b, moved = self.layer_buckets(kind, mesh, micro_batch, ch, counts)
                # the layer's own (its input is kept), before the transition's are added
                op_comm = self.op_recompute(f_b, mesh) if st.op_level else (0.0, 0.0)
                if prev is not None:
                    tf, tb, moved_t = self.transition_buckets(prev, kind, mesh, micro_batch,
                                                              st.of(prev), ch, counts)
                    for k, v in tf.items():
                        f_b[k] = f_b.get(k, 0.0) + v
                    for k, v in tb.items():
                        b_b[k] = b_b.get(k, 0.0) + v
                else:
                    moved_t = {}
                cpu = (0.0, 0.0)
                if composer is not None:
                    mm = sum(int(kc.tp_matmuls[ai][j]) for ai, j in enumerate(ch))
                    cpu = (self.cpu_layer_time(f_b, counts, mesh, mm),
                           self.cpu_layer_time(b_b, counts, mesh, mm))
                comm_cache[key] = (self._time(f_b, mesh), self._time(b_b, mesh), moved,
                                   moved_t, cpu, op_comm)
            lf, lb, moved, moved_t, cpu, op_comm = comm_cache[key]
            tp_f += lf
            tp_b += lb
            cpu_f += cpu[0]
            cpu_b += cpu[1]
            recompute = st.checkpoint and ms.is_block[l]
            selective = st.selective and not st.checkpoint and ms.is_block[l]
            op_level = st.op_level and not st.checkpoint and ms.is_block[l]
            layer_psi = np.zeros(len(BUCKETS))
            layer_act = layer_core = layer_op = 0.0
            layer_gathered = 0.0
            for ai, j in enumerate(ch):
                fwd += kc.fwd[ai][j]
                bwd += kc.bwd[ai][j]
                ex = kc.extra[ai][j]
                gemm_f += ex[GEMM_FWD]
                gemm_b += ex[GEMM_BWD]
                if selective:
                    core += ex[CORE_FWD]
                    layer_core += ex[CORE_ACT]
                elif op_level:
                    core += ex[OP_FWD]
                    layer_op += ex[OP_ACT]
                layer_act += kc.act[ai][j]
                layer_gathered += kc.gathered[ai][j]
                p = kc.psi[ai][j]
                extra = moved.get(ai, ())
                if extra:                  # deferred Partial gradients: more sync axes
                    q = np.zeros(len(BUCKETS))
                    for b, axes in enumerate(BUCKETS):
                        q[BUCKETS.index(tuple(sorted(set(axes) | set(extra))))] += p[b]
                    p = q
                layer_psi += p
            if prev is not None:
                # the previous layer's sink anchors reached by this layer's Partial gradients
                kc_p = self.kind_costs(prev, mesh, micro_batch)
                for ai, axes in moved_t.items():
                    p = kc_p.psi[ai][st.of(prev)[ai]]
                    for b, b_axes in enumerate(BUCKETS):
                        if p[b]:
                            layer_psi[b] -= p[b]
                            layer_psi[BUCKETS.index(tuple(sorted(set(b_axes) | set(axes))))] \
                                += p[b]
            psi += layer_psi
            gathered = max(gathered, layer_gathered)
            layer_act += self._imported(st, l, micro_batch)
            if recompute:
                act += self._kept_input(st, l, micro_batch)
                peak = max(peak, layer_act)
            elif selective:      # the attention matrices recomputed, one layer's at a time
                act += layer_act - layer_core
                peak = max(peak, layer_core)
            elif op_level:       # input and kept outputs; the rest and its collectives again
                core += op_comm[0]
                act += self._kept_input(st, l, micro_batch) + layer_op + op_comm[1]
                peak = max(peak, layer_act)
            else:
                act += layer_act
        send = 0.0
        if not last:
            out_bytes = self.graph.layers[st.end - 1].stats.output_bytes * micro_batch \
                / self.b0 / mesh.size
            send = self.cm.coll("send_recv", out_bytes,
                                Group(size=2, ranks_per_node=1 if cross_node else 2))
        modules = 1 + sum(bool(ms.is_block[l]) for l in range(st.start, st.end))
        buckets = tuple(ParamBucket(axes, float(psi[b]), mesh.group(axes))
                        for b, axes in enumerate(BUCKETS) if psi[b] > 0)
        return ChunkCost(float(fwd), float(bwd), float(tp_f), float(tp_b), float(send),
                         float(act), float(peak), st.checkpoint, buckets, float(gathered),
                         st.zero, mesh.size, float(cpu_f), float(cpu_b), modules,
                         transient=temporary_bytes(self.graph, st.start, st.end,
                                                   micro_batch / self.b0, mesh.size,
                                                   eager=self.cm.eager_loss),
                         selective=float(core),
                         tp_overlap=mesh.shape[-1] if st.tp_overlap else 0,
                         gemm_fwd=float(gemm_f), gemm_bwd=float(gemm_b))

    def _imported(self, st: StageChoice, l: int, micro_batch: int) -> float:
        """Saved bytes of what layer ``l`` reads from layer ``l - 1``, as it places them."""
        if l == 0:
            return 0.0
        prev, kind = self.ms.layer_kind[l - 1], self.ms.layer_kind[l]
        kc_a = self.kind_costs(prev, st.mesh, micro_batch)
        kc_b = self.kind_costs(kind, st.mesh, micro_batch)
        ch = st.of(kind)
        out = 0.0
        for v, nbytes, specs in self.ms.imported(prev, kind, kc_a, kc_b):
            spec = specs[ch[v]]
            out += nbytes / math.prod(st.mesh.shape[a] for a in range(2)
                                      if spec is not None and spec[a].startswith("S"))
        return out

    def _kept_input(self, st: StageChoice, l: int, micro_batch: int) -> float:
        """A recomputed layer keeps its input, sharded as its producer leaves it (as its
        consumers read it, for the first layer of a stage, which receives it)."""
        ms = self.ms
        if l == 0:
            return self.graph.layers[l].stats.input_bytes * micro_batch / self.b0
        prev, kind = ms.layer_kind[l - 1], ms.layer_kind[l]
        kc_a = self.kind_costs(prev, st.mesh, micro_batch)
        kc_b = self.kind_costs(kind, st.mesh, micro_batch)
        seen: dict[tuple[int, int], float] = {}
        for e in transition_edges(ms, (prev, kind), kc_a, kc_b):
            if l > st.start:
                spec = kc_a.out_spec[e.u][(e.p, e.o)][st.of(prev)[e.u]]
            else:
                spec = kc_b.in_info[(e.m, e.q)][1][st.of(kind)[e.v]]
            shard = math.prod(st.mesh.shape[a] for a in range(2)
                              if spec is not None and spec[a].startswith("S"))
            seen[(e.p, e.o)] = min(seen.get((e.p, e.o), math.inf), e.nbytes / shard)
        if not seen:
            return self.graph.layers[l].stats.input_bytes * micro_batch / self.b0
        return sum(seen.values())

    # ---- the plan -----------------------------------------------------------------------
    def chunks(self, p: PipelineChoice) -> list[ChunkCost]:
        """The stages of ``p`` priced, in order (chunk c on pipeline rank c mod pp)."""
        n_chunks, pp = len(p.stages), p.pp
        offsets = self.rank_offsets(p)
        out = []
        for c, st in enumerate(p.stages):
            last = c == n_chunks - 1
            nxt = (c + 1) % pp
            cross = True if last else self.cross_node(offsets[c % pp], st.mesh.size,
                                                      offsets[nxt], p.stages[c + 1].mesh.size)
            out.append(self.stage_cost(st, p.micro_batch, last=last, cross_node=cross))
        return out

    def workload(self, p: PipelineChoice) -> Workload:
        gb = p.global_batch
        graph = self.graph
        model_flops = (graph.fwd_flops + graph.bwd_flops) * gb / self.b0

        def partial(mode: str, nodes: frozenset[str]) -> float:
            """Forward FLOPs of ``nodes`` in the blocks of the stages recomputing by ``mode``."""
            return core_fwd_flops(graph, [l for st in p.stages if st.recompute == mode
                                          for l in range(st.start, st.end)
                                          if self.ms.is_block[l]], nodes)

        recompute_flops = (sum(graph.layers[l].stats.fwd_flops
                               for st in p.stages if st.checkpoint
                               for l in range(st.start, st.end) if self.ms.is_block[l])
                           + partial("selective", self.cm._core_and_gemms[0])
                           + partial("op", self.cm.op_sets[1])) * gb / self.b0
        return Workload(num_micro_batches=p.num_micro_batches, schedule=p.schedule,
                        virtual_stages=p.virtual_stages, samples=gb,
                        tokens=gb * (graph.batch.seq_len or 1), model_flops=model_flops,
                        recompute_flops=recompute_flops)

    def predict(self, p: PipelineChoice) -> Prediction:
        """The prediction for ``p`` (:meth:`autoplan.cost.step.StepModel.compose`)."""
        return self.step.compose(self.chunks(p), self.workload(p))

    # ---- placement of stages on the cluster ----------------------------------------------
    @staticmethod
    def devices(p: PipelineChoice) -> int:
        return sum(p.stages[d].mesh.size for d in range(p.pp))

    @staticmethod
    def rank_offsets(p: PipelineChoice) -> list[int]:
        """First global rank of each pipeline rank's submesh (consecutive, in order)."""
        out, pos = [], 0
        for d in range(p.pp):
            out.append(pos)
            pos += p.stages[d].mesh.size
        return out

    def cross_node(self, a_start: int, a_size: int, b_start: int, b_size: int) -> bool:
        """Consecutive stages talk inside a node when both fit in one (the Estimator's
        rule for pipeline sends)."""
        return self.cm.cluster.nodes > 1 and a_size + b_size > self.cm.cluster.devices_per_node


def _record_edge_plan(ev: Evaluator, kc: KindCosts, choice: tuple[int, ...]
                      ) -> tuple[list, dict]:
    """The additions :meth:`Evaluator._edge_buckets` makes for ``kc``'s own edges under
    ``choice``, as (direction, bucket, edge index, divisor), in order, and the sinks'
    deferred axes: everything but the bytes, which are the edges' own at each micro-batch
    (``edge.nbytes / divisor``), recorded by running it once."""
    fwd: Buckets = {}
    bwd: Buckets = {}
    moved: dict[int, tuple[int, ...]] = {}
    adds: list = []
    ev._edge_buckets(kc, kc, kc.edges, choice, choice, fwd, bwd, moved, adds=adds)
    return adds, moved
