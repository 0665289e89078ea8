"""Predict the step time and memory of a searched plan — the uniform planner's composition,
stage by stage.

The search chooses, per pipeline stage, a layer range, a logical mesh, one placement per op
group of each layer kind, a ZeRO stage and recomputation (:class:`StageChoice`). This
module prices that choice with the same formulas as
:class:`~autoplan.planner.estimate.Estimator` (its docstring has them), generalised from
"TP degree t" to per-op placements:

* per micro-batch, stage c: compute t_f(c), t_b(c) = the ops' ``op_time`` under their
  placements (:mod:`autoplan.planner.costs`); *layer communication* tp_f(c), tp_b(c) = the
  resharding the placements imply, forward and backward; send(c) = the stage's output
  activation split over its devices (Megatron's scatter/gather), to the next stage.
* Collectives of one kind along one mesh axis in one layer and direction are costed as one
  collective of their summed bytes — the Estimator's convention (``LayerStats.
  tp_allreduce_*_bytes`` is one all-reduce per layer), so a Megatron layout is priced
  exactly as the uniform planner prices it.
* pipeline latency (Alpa eq. 2; interleaved: Narayanan et al. 2021)::

      T = sum_d T_d + (m - 1) max_d T_d                 v = 1   (1F1B, GPipe)
      T = m max_d T_d + (pp - 1) max_d T_d / v          interleaved 1F1B

  with T_d = sum over the chunks of pipeline rank d of t_f + t_b + tp_f + tp_b + 2 send
  (+ t_f + tp_f when recomputed).
* per step: each bucket of parameters (by the mesh axes their gradients are summed over)
  is all-reduced once (one collective per bucket), overlapped with the last micro-batch's
  backward; ZeRO-3 gathers parameters twice per micro-batch, overlapped with its compute
  (``_exposed``: what compute cannot hide plus OVERLAP_COST of the rest); the optimizer
  step is ``ComputeModel.optimizer_time`` of the local (ZeRO-sharded) parameters. Each is
  the slowest pipeline rank's.
* memory per device of pipeline rank d: ZeRO model states per bucket, activations x
  micro-batches in flight (:func:`~autoplan.cost.memory.in_flight_micro_batches`), one
  recomputed layer's activations, and under ZeRO-3 two layers' gathered parameters.

Two refinements over the Estimator, both only where a uniform plan never goes: ops on
tensors without a batch dimension (a causal mask) do not scale with the micro-batch, and a
Partial gradient reaching an op whose inputs need no gradient (a position embedding
broadcast over a sharded batch) is summed with the parameter gradients once per step
rather than per micro-batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from autoplan.cost.comm import Group
from autoplan.cost.memory import in_flight_micro_batches
from autoplan.plan import MemoryBreakdown, Prediction, TimeBreakdown
from autoplan.planner.compose import ModelStructure, transition_edges
from autoplan.planner.costs import (BUCKETS, REDUCE_BYTES, CostModel, KindCosts, TensorEdge,
                                    conversions, grad_spec, passes_partial, required_grad)
from autoplan.planner.estimate import _exposed
from autoplan.planner.mesh import LogicalMesh

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


@dataclass
class StageCost:
    fwd: float
    bwd: float
    tp_fwd: float
    tp_bwd: float
    send: float
    act: float
    recompute_peak: float
    psi: np.ndarray                       # local parameters per bucket
    gathered: float                       # largest layer's gathered parameter bytes
    checkpoint: bool
    zero: int
    mesh: LogicalMesh
    layer_comm: dict = field(default_factory=dict)   # kind -> (fwd Buckets, bwd Buckets)
    cpu_tp_fwd: float = 0.0               # layer communication on shared cores (composer)
    cpu_tp_bwd: float = 0.0
    modules: int = 0                      # the stage's root and its blocks (FSDP's units)


class Evaluator:
    """Prices :class:`PipelineChoice` objects for one (graph, cluster, precision)."""

    def __init__(self, cm: CostModel, ms: ModelStructure):
        self.cm = cm
        self.ms = ms
        self.graph = ms.graph
        self.b0 = ms.graph.batch.batch_size
        self._kc: dict[tuple[str, LogicalMesh, int], KindCosts] = {}
        self._trans: dict[tuple, tuple[float, float]] = {}
        self.output_bytes = np.array([l.stats.output_bytes for l in ms.graph.layers],
                                     dtype=float)

    def kind_costs(self, kind: str, mesh: LogicalMesh, micro_batch: int) -> KindCosts:
        key = (kind, mesh, micro_batch)
        if key not in self._kc:
            self._kc[key] = self.ms.kind_costs(self.cm, kind, mesh, micro_batch)
        return self._kc[key]

    # ---- communication of one layer ------------------------------------------------------
    def _edge_buckets(self, kc_u: KindCosts, kc_v: KindCosts, edges: list[TensorEdge],
                      cu: tuple[int, ...], cv: tuple[int, ...], fwd: Buckets, bwd: Buckets,
                      moved: dict[int, tuple[int, ...]],
                      counts: dict | None = None) -> None:
        """Add the collectives of ``edges`` under choices ``cu``/``cv``; Partial gradients
        into one producer group (a tensor and its views) summed once; Partial gradients into
        a sink deferred (``moved``: anchor of the sink -> extra sync axes). ``counts``
        (bucket -> collectives) counts a gradient summed once for several consumers once
        per consumer, as per-module DTensor issues them (:meth:`cpu_layer_time`)."""
        shape = kc_v.mesh.shape
        done: set[tuple[int, int]] = set()
        tally = counts if counts is not None else {}
        for e in edges:
            src = kc_u.out_spec[e.u][(e.p, e.o)][cu[e.u]]
            _, dsts, spl = kc_v.in_info[(e.m, e.q)]
            dst, sp = dsts[cv[e.v]], spl[cv[e.v]]
            if src is None or dst is None:
                continue
            for c in conversions(src, dst, shape):
                key = ("fwd", c.collective, c.axis)
                fwd[key] = fwd.get(key, 0.0) + e.nbytes / c.divisor
                tally[key] = tally.get(key, 0) + 1
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
        self._edge_buckets(kc, kc, kc.edges, choice, choice, fwd, bwd, moved, counts)
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
        """(forward, backward) seconds of the transition's collectives on their own."""
        key = (ka, kb, mesh, micro_batch, ca, cb)
        hit = self._trans.get(key)
        if hit is None:
            tf, tb, _ = self.transition_buckets(ka, kb, mesh, micro_batch, ca, cb)
            hit = self._trans[key] = (self._time(tf, mesh), self._time(tb, mesh))
        return hit

    def _time(self, buckets: Buckets, mesh: LogicalMesh) -> float:
        return sum(self.cm.coll(coll, nbytes, mesh.group((axis,)))
                   for (_, coll, axis), nbytes in sorted(buckets.items()))

    # ---- ranks sharing CPU cores ---------------------------------------------------------
    @property
    def composer(self):
        """The cluster's :class:`~autoplan.cost.shared_cores.SharedCoreComposer` when its
        ranks share CPU cores (None otherwise): the Estimator composes its predictions with
        it, and so does :meth:`predict`."""
        comp = getattr(self.cm.provenance, "composer", None)
        return comp if comp is not None and comp.share < 1 else None

    def cpu_layer_time(self, buckets: Buckets, counts: dict, mesh: LogicalMesh,
                       tp_matmuls: int) -> float:
        """One direction of a layer's communication on shared cores, as
        :mod:`autoplan.cost.shared_cores` counts the engine's DTensor TP: each bucket's
        bytes in as many collectives as consumers issue them, and DTensor's per-module work
        (half of ``tp_matmul_overhead_s`` per sharded matmul and direction, at the share)."""
        comp = self.composer
        t = tp_matmuls * comp.tp_matmul_overhead_s / 2 / comp.share
        for key, nbytes in sorted(buckets.items()):
            if nbytes <= 0:
                continue
            _, coll, axis = key
            n = max(counts.get(key, 1), 1)
            t += n * self.cm.coll(coll, nbytes / n, mesh.group((axis,)))
        return t

    # ---- one stage -------------------------------------------------------------------------
    def stage_cost(self, st: StageChoice, micro_batch: int, *, last: bool,
                   cross_node: bool) -> StageCost:
        return self._stage_cost(st, micro_batch, last, cross_node)

    @functools.lru_cache(maxsize=4096)
    def _stage_cost(self, st: StageChoice, micro_batch: int, last: bool,
                    cross_node: bool) -> StageCost:
        ms, mesh = self.ms, st.mesh
        fwd = bwd = tp_f = tp_b = act = peak = gathered = 0.0
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
                                   moved_t, cpu)
            lf, lb, moved, moved_t, cpu = comm_cache[key]
            tp_f += lf
            tp_b += lb
            cpu_f += cpu[0]
            cpu_b += cpu[1]
            recompute = st.checkpoint and ms.is_block[l]
            layer_psi = np.zeros(len(BUCKETS))
            layer_act = 0.0
            layer_gathered = 0.0
            for ai, j in enumerate(ch):
                fwd += kc.fwd[ai][j]
                bwd += kc.bwd[ai][j]
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
            else:
                act += layer_act
        send = 0.0
        if not last:
            out_bytes = self.graph.layers[st.end - 1].stats.output_bytes * micro_batch \
                / self.b0 / mesh.size
            send = self.cm.coll("send_recv", out_bytes,
                                Group(size=2, ranks_per_node=1 if cross_node else 2))
        modules = 1 + sum(bool(ms.is_block[l]) for l in range(st.start, st.end))
        return StageCost(fwd, bwd, tp_f, tp_b, send, act, peak, psi, gathered, st.checkpoint,
                         st.zero, mesh, cpu_tp_fwd=cpu_f, cpu_tp_bwd=cpu_b, modules=modules)

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
    def predict(self, p: PipelineChoice) -> Prediction:
        cm = self.cm
        n_chunks = len(p.stages)
        pp, v, m = p.pp, p.virtual_stages, p.num_micro_batches
        offsets = self.rank_offsets(p)
        chunks = []
        for c, st in enumerate(p.stages):
            last = c == n_chunks - 1
            nxt = (c + 1) % pp
            cross = True if last else self._cross(offsets[c % pp], st.mesh.size,
                                                   offsets[nxt], p.stages[c + 1].mesh.size)
            chunks.append(self.stage_cost(st, p.micro_batch, last=last, cross_node=cross))

        def t_chunk(c: StageCost) -> float:
            t = c.fwd + c.bwd + c.tp_fwd + c.tp_bwd + 2 * c.send
            if c.checkpoint:
                t += c.fwd + c.tp_fwd
            return t

        dev_chunks = [[chunks[c] for c in range(d, n_chunks, pp)] for d in range(pp)]
        dev_time = [sum(t_chunk(c) for c in cs) for cs in dev_chunks]
        slow = max(range(pp), key=lambda d: dev_time[d])
        if v == 1:
            pipeline = sum(dev_time) + (m - 1) * dev_time[slow]
        else:
            pipeline = m * dev_time[slow] + (pp - 1) * dev_time[slow] / v
        sc = dev_chunks[slow]
        compute = m * sum(c.fwd + c.bwd for c in sc)
        recompute = m * sum(c.fwd for c in sc if c.checkpoint)
        tp_comm = m * sum(c.tp_fwd + c.tp_bwd + (c.tp_fwd if c.checkpoint else 0.0) for c in sc)
        pp_comm = m * sum(2 * c.send for c in sc)
        bubble = max(0.0, pipeline - compute - recompute - tp_comm - pp_comm)

        dp_exposed, opt_time, per_stage, syncs = [], [], [], []
        for d, cs in enumerate(dev_chunks):
            mesh = cs[0].mesh
            psi = sum(c.psi for c in cs)
            zero = cs[0].zero
            last_bwd = sum(c.bwd for c in cs)
            mb_compute = sum(c.fwd + c.bwd for c in cs)
            groups = [mesh.group(axes) for axes in BUCKETS]
            t_reduce = sum(cm.coll("all_reduce", psi[b] * REDUCE_BYTES, groups[b])
                           for b in range(len(BUCKETS)) if groups[b].size > 1)
            exposed = _exposed(t_reduce, last_bwd) if t_reduce > 0 else 0.0
            t_gather = 0.0
            if zero == 3:
                t_gather = sum(cm.coll("all_gather", psi[b] * cm.param_bytes, groups[b])
                               for b in range(len(BUCKETS)) if groups[b].size > 1)
                if t_gather > 0:
                    exposed += m * _exposed(2 * t_gather, mb_compute)
            dp_exposed.append(exposed)
            dsize = np.array([g.size for g in groups], dtype=float)
            local = float((psi / dsize).sum()) if zero >= 1 else float(psi.sum())
            opt_time.append(cm.compute.optimizer_time(local))
            syncs.append((t_reduce, t_gather, local))
            p_b, g_b, o_b = cm.state_bytes
            params = float(sum(psi[b] * p_b / (dsize[b] if zero >= 3 else 1)
                               for b in range(len(BUCKETS))))
            grads = float(sum(psi[b] * g_b / (dsize[b] if zero >= 2 else 1)
                              for b in range(len(BUCKETS))))
            optim = float(sum(psi[b] * o_b / (dsize[b] if zero >= 1 else 1)
                              for b in range(len(BUCKETS))))
            in_flight = in_flight_micro_batches(p.schedule, pp, d, m, v)
            acts = in_flight * sum(c.act for c in cs) + max(c.recompute_peak for c in cs)
            other = 0.0
            if zero == 3 and any(g.size > 1 for g, x in zip(groups, psi) if x):
                other = 2 * max(c.gathered for c in cs)
            per_stage.append(MemoryBreakdown(params=params, grads=grads, optimizer=optim,
                                             activations=acts, other=other))
        dp_comm = max(dp_exposed)
        optimizer = max(opt_time)
        step = pipeline + dp_comm + optimizer
        worst = max(per_stage, key=lambda mb: mb.total)

        gb = p.global_batch
        tokens = gb * (self.graph.batch.seq_len or 1)
        model_flops = (self.graph.fwd_flops + self.graph.bwd_flops) * gb / self.b0
        recompute_flops = sum(self.graph.layers[l].stats.fwd_flops
                              for st in p.stages if st.checkpoint
                              for l in range(st.start, st.end) if self.ms.is_block[l]) \
            * gb / self.b0
        world = self.devices(p)
        peak = cm.compute.peak
        time = TimeBreakdown(compute=compute, recompute=recompute, tp_comm=tp_comm,
                             dp_comm=dp_comm, pp_comm=pp_comm, bubble=bubble,
                             optimizer=optimizer)
        if self.composer is not None:
            step, time = self._shared_cores(p, dev_chunks, syncs, step)
        return self._calibrated(Prediction(
            step_time_s=step, tokens_per_s=tokens / step, samples_per_s=gb / step,
            model_tflops_per_device=model_flops / step / world / 1e12,
            hardware_tflops_per_device=(model_flops + recompute_flops) / step / world / 1e12,
            mfu=model_flops / step / world / peak, memory=worst,
            memory_limit_bytes=self.cm.cluster.device.memory_bytes,
            time=time, memory_per_stage=tuple(per_stage)))

    def _shared_cores(self, p: PipelineChoice, dev_chunks: list[list[StageCost]],
                      syncs: list[tuple[float, float, float]], step: float
                      ) -> tuple[float, TimeBreakdown]:
        """The step on ranks sharing CPU cores (:mod:`autoplan.cost.shared_cores`, as the
        Estimator composes it): ``max(T_cap, share x step)``, T_cap the mean over ranks of
        each rank's work (pipeline rank d's, on each of its submesh's devices: a mean
        weighted by submesh size, which for equal submeshes is the Estimator's mean over
        pipeline ranks). Returns (step, breakdown: the mean rank's terms, bubble the rest)."""
        comp = self.composer
        cm = self.cm
        m = p.num_micro_batches
        keys = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "optimizer")
        total = dict.fromkeys(keys, 0.0)
        devices = 0
        for cs, (t_reduce, t_gather, local) in zip(dev_chunks, syncs):
            n = cs[0].mesh.size
            w = dict.fromkeys(keys, 0.0)
            for c in cs:
                w["compute"] += m * (c.fwd + c.bwd)
                w["recompute"] += m * c.fwd if c.checkpoint else 0.0
                w["tp_comm"] += m * (c.cpu_tp_fwd + c.cpu_tp_bwd +
                                     (c.cpu_tp_fwd if c.checkpoint else 0.0))
                w["pp_comm"] += m * 2 * c.send
            if t_reduce > 0:         # data parallel: FSDP's per-module work, and in full
                w["dp_comm"] += m * sum(c.modules for c in cs) * comp.dp_module_overhead_s \
                    / comp.share
                w["dp_comm"] += t_reduce + m * 2 * t_gather
            w["optimizer"] = comp.optimizer_scale * cm.compute.optimizer_time(local)
            for k in keys:
                total[k] += n * w[k]
            devices += n
        avg = {k: v / devices for k, v in total.items()}
        capacity = sum(avg.values())
        out = max(capacity, comp.share * step)
        return out, TimeBreakdown(**avg, bubble=out - capacity)

    def _calibrated(self, pred: Prediction) -> Prediction:
        """The cluster's calibration factors per term, as the Estimator applies them (the
        Estimator's composition for ranks sharing CPU cores is uniform-only: not here);
        plain Python floats throughout (the plan's JSON)."""
        pred = self.cm.calibration.apply(pred) if self.cm.calibration else pred
        mem = lambda m: MemoryBreakdown(**{f: float(getattr(m, f)) for f in   # noqa: E731
                                           ("params", "grads", "optimizer", "activations",
                                            "other")})
        t = pred.time
        return Prediction(
            step_time_s=float(pred.step_time_s), tokens_per_s=float(pred.tokens_per_s),
            samples_per_s=float(pred.samples_per_s),
            model_tflops_per_device=float(pred.model_tflops_per_device),
            hardware_tflops_per_device=float(pred.hardware_tflops_per_device),
            mfu=float(pred.mfu), memory=mem(pred.memory),
            memory_limit_bytes=float(pred.memory_limit_bytes),
            time=TimeBreakdown(**{f: float(getattr(t, f)) for f in (
                "compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble",
                "optimizer")}),
            memory_per_stage=tuple(mem(m) for m in pred.memory_per_stage))

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

    def _cross(self, a_start: int, a_size: int, b_start: int, b_size: int) -> bool:
        """Consecutive stages talk inside a node when both fit in one (the Estimator's
        rule for pipeline sends)."""
        return self.cm.cluster.nodes > 1 and a_size + b_size > self.cm.cluster.devices_per_node
