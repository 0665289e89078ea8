"""The Alpa-style search: intra-op ILP layouts placed by the inter-op stage DP.

    result = search(spec, graph, cluster, global_batch=1536)
    result.prediction.step_time_s, result.best.stages[0].mesh

Steps (timings in ``SearchResult.seconds``):

1. **Analyse** the model once (:func:`~autoplan.planner.search.compose.analyse`): DTensor strategies
   per op of one layer of each kind, on a fake process group.
2. **Intra-op pass** (:mod:`~autoplan.planner.search.library`): the ILP of
   :mod:`~autoplan.planner.search.intra_op` on the whole model, on the cluster's and one node's
   logical meshes, at several memory weights, plus Megatron's layouts; the optimal
   placements become each kind's candidate *layouts*.
3. For every micro-batch count m (divisors of the global batch; the micro-batch B = batch /
   m is split over each stage's batch-sharded axes):

   * price every layout of every kind on every submesh's logical meshes
     (:func:`~autoplan.planner.search.kind_tables.kind_table`), and every unit range on
     every submesh at every pipeline position
     (:func:`~autoplan.planner.search.tables.range_table`): the best
     (layouts, ZeRO stage, recomputation) that fits in device memory -- recomputation none,
     full or selective (the attention core, :mod:`autoplan.cost.recompute`; where blocks
     keep attention matrices), and op-level (torchtitan's per-op policy) where the options
     ask for it, per stage, a plan never mixing two modes that recompute;
   * **inter-op pass**: Alpa's DP over stages and submeshes
     (:func:`~autoplan.planner.search.inter_op.pipeline_dp`) for 1F1B (GPipe has the same latency
     and more activations in flight);
   * **balanced pipelines**: p equal submeshes with the blocks split evenly, for every
     schedule including interleaved 1F1B with v chunks per submesh (Narayanan et al. 2021),
     which the DP's contiguous stages cannot express; an interleaved rank's memory is
     screened as the schedule holds its chunks (:func:`autoplan.schedule.live_chunks`), as
     the exact pricing holds them, so a chunk with the embedding or the head is not
     averaged with the others.

4. The best candidates of all m are priced exactly (:class:`~autoplan.planner.search.evaluate.
   Evaluator`, the uniform planner's formulas) and the fastest that fits wins.

The counts m are searched most first, and a count whose latencies provably cannot reach
the exact pricing (a lower bound from its kind tables, :mod:`~autoplan.planner.search.prune`)
is skipped after its kind tables: the priced candidates are those of the full search.

Layers are grouped into at most ``max_units`` units (non-block layers alone, repeated
blocks in even groups) and the cluster into at most ``max_device_units`` device units: whole
nodes (several per unit on large clusters), or single devices inside a one-node cluster,
where stages take Alpa's (1, 2^k) submeshes. A stage of whole nodes takes a power of two or
a divisor of the device units (Alpa allows any count; these keep the tables small).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from autoplan.cluster import Cluster
from autoplan.cost.memory import (DEFAULT_HEADROOM, in_flight_micro_batches, solver_budget_bytes,
                                  solver_state_weight)
from autoplan.errors import InfeasibleError
from autoplan.graph import OpGraph
from autoplan.plan import Prediction
from autoplan.planner.build import split_layers
from autoplan.planner.search.compose import ModelStructure, analyse
from autoplan.planner.search.costs import CostModel
from autoplan.planner.grid.estimate import divisors
from autoplan.planner.search.evaluate import Evaluator, PipelineChoice, StageChoice
from autoplan.planner.search.inter_op import pipeline_dp
from autoplan.planner.search.library import LAMBDAS, Library, build_library
from autoplan.planner.search.mesh import LogicalMesh, submesh_shapes
from autoplan.planner.search.kind_tables import KindTable, kind_table
from autoplan.planner.search.prune import Ranked, latency_lower_bound
from autoplan.planner.search.tables import (INF, Combos, LayerArrays, SharedRows, layer_arrays,
                                            range_table, tie_key)
from autoplan.schedule import live_chunks, runs_micro_batches

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """Bounds of the search; ``None`` means automatic."""

    micro_batches: tuple[int, ...] | None = None    # counts m to try
    max_micro_batches: int = 256
    max_units: int = 32
    split_at_blocks: bool = False       # stages begin at blocks only (the generic runtime)
    max_device_units: int = 32
    max_stages: int = 32
    virtual_stages: tuple[int, ...] = (2, 4)
    zero: tuple[int, ...] = (0, 1, 2, 3)
    checkpoint: tuple[bool | str, ...] = (False, True, "selective")   # "selective": the
    # attention core (autoplan.cost.recompute), only where blocks keep attention matrices;
    # "op": op-level recomputation (autoplan.cost.recompute), opt-in as in the grid
    lambdas: tuple[float, ...] = (0.0, 1e-11, 1e-10, math.inf)
    library_lambdas: tuple[float, ...] = LAMBDAS
    megatron_seeds: bool = True
    backend: str = "CBC"
    exact_candidates: int = 12
    prune_micro_batches: bool = True    # skip counts that provably cannot be priced (prune.py)


@dataclass
class Candidate:
    choice: PipelineChoice
    estimate: float                 # the tables' latency (s per step)
    origin: str                     # "stage DP" | "balanced"
    prediction: Prediction | None = None


@dataclass
class SearchResult:
    best: PipelineChoice
    prediction: Prediction
    ranked: list[Candidate]                       # exactly priced, fastest first, fitting
    evaluator: Evaluator
    structure: ModelStructure
    library: Library
    seconds: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


# ---- units --------------------------------------------------------------------------------

def layer_units(ms: ModelStructure, max_units: int, *, split_at_blocks: bool = False
                ) -> list[int]:
    """Layer index where each unit starts, plus the end: non-block layers alone, blocks in
    even groups so that there are at most ``max_units`` units. ``split_at_blocks``: a
    non-block layer after a block joins that block's unit instead (the generic runtime
    splits a model only at a block's module, so no stage may begin with ``<post>``)."""
    n = len(ms.layer_kind)
    blocks = [l for l in range(n) if ms.is_block[l]]
    singles = n - len(blocks)
    room = max(1, max_units - singles)
    group = max(1, math.ceil(len(blocks) / room))
    starts, run = [], 0
    first_block = blocks[0] if blocks else n
    for l in range(n):
        if not ms.is_block[l]:
            if split_at_blocks and l > first_block:      # after a block: join its unit
                continue
            starts.append(l)
            run = 0
        else:
            if run % group == 0:
                starts.append(l)
            run += 1
    return starts + [n]


def device_units(cluster: Cluster, max_units: int) -> tuple[int, int, list[int]]:
    """(devices per unit, number of units V, submesh sizes in units)."""
    dpn = cluster.devices_per_node
    if cluster.nodes == 1:
        sizes = [2 ** k for k in range(int(math.log2(dpn)) + 1) if 2 ** k <= dpn]
        return 1, dpn, sizes
    per = next(d for d in divisors(cluster.nodes) if cluster.nodes // d <= max_units)
    v = cluster.nodes // per
    sizes = sorted(set(divisors(v)) | {2 ** k for k in range(int(math.log2(v)) + 1)})
    return per * dpn, v, sizes


def micro_batch_counts(global_batch: int, opts: SearchOptions, device_units: int = 32
                       ) -> list[int]:
    """Divisors m of the global batch up to ``max_micro_batches`` and to 8 per device unit
    (at least 32): more micro-batches than 8 per possible pipeline stage no longer shrink
    the bubble much, and each halves the micro-batch."""
    if opts.micro_batches is not None:
        return [m for m in opts.micro_batches if global_batch % m == 0]
    cap = min(opts.max_micro_batches, max(32, 8 * device_units))
    return [m for m in divisors(global_batch) if m <= cap]


# ---- the search ---------------------------------------------------------------------------

class _Workspace:
    """Caches of one search: kind tables and layer arrays."""

    def __init__(self, ev: Evaluator, lib: Library):
        self.ev = ev
        self.lib = lib
        self.tables: dict[tuple[str, LogicalMesh, int], KindTable | None] = {}
        self.arrays: dict[tuple, LayerArrays] = {}

    def kind_table(self, kind: str, mesh: LogicalMesh, micro_batch: int) -> KindTable | None:
        key = (kind, mesh, micro_batch)
        if key not in self.tables:
            try:
                self.tables[key] = kind_table(self.ev, kind, mesh, micro_batch,
                                              self.lib.layouts.get(kind, []))
            except ValueError:        # an op with no placement valid on this mesh
                self.tables[key] = None
        return self.tables[key]

    def layer_arrays(self, micro_batch: int):
        def get(mesh: LogicalMesh, kt: dict, pick: dict[str, int], ck: bool) -> LayerArrays:
            layouts = tuple(sorted(pick.items()))
            key = (mesh, micro_batch, layouts, ck)
            if key not in self.arrays:
                # recomputed: from the same layouts' plain arrays (layer_arrays' plain)
                plain = get(mesh, kt, pick, False) if ck is not False else None
                self.arrays[key] = layer_arrays(self.ev, mesh, micro_batch, kt, pick, ck,
                                                plain=plain)
            return self.arrays[key]
        return get


def search(spec, graph: OpGraph, cluster: Cluster, *, global_batch: int,
           precision: str = "mixed", options: SearchOptions = SearchOptions(),
           structure: ModelStructure | None = None,
           memory_headroom: float = DEFAULT_HEADROOM,
           fused: bool = True, fused_loss: bool | None = None,
           float8_recipe: str = "torchao", attention_kernel: str = "flash2") -> SearchResult:
    """(module docstring) Raises InfeasibleError when nothing fits. ``memory_headroom``:
    the fraction of device memory plans leave free; ``fused`` / ``fused_loss``: whether the
    runtime fuses element-wise ops / the loss's backward; ``float8_recipe``: whose float8
    casts a ``mixed-fp8`` step pays; ``attention_kernel``: which fused attention runs
    (:func:`autoplan.api.prepare`)."""
    from autoplan.planner.bounds import check_devices_fed

    check_devices_fed(graph, cluster, global_batch)
    opts = options
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    ms = structure or analyse(spec, graph)
    seconds["analyse"] = time.perf_counter() - t0
    cm = CostModel(graph, cluster, precision=precision, fused=fused, fused_loss=fused_loss,
                   memory_headroom=memory_headroom, float8_recipe=float8_recipe,
                   attention_kernel=attention_kernel)
    ev = Evaluator(cm, ms)
    t1 = time.perf_counter()
    lib = build_library(ev, ms, cluster.world_size, global_batch,
                        lambdas=opts.library_lambdas, backend=opts.backend,
                        megatron=opts.megatron_seeds)
    seconds["intra_op"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    ws = _Workspace(ev, lib)
    units = layer_units(ms, opts.max_units, split_at_blocks=opts.split_at_blocks)
    per_unit, v_units, sizes = device_units(cluster, opts.max_device_units)
    dpn = cluster.devices_per_node
    # (calibrated memory fits; the overheads the ILP does not model held back)
    memory = solver_budget_bytes(cm.memory_limit_bytes, ev.step.gpu) / cm.memory_factor
    # selective recomputation saves nothing where no block keeps an attention matrix
    attn = any(l.stats.saved_bytes_attn for l in ms.graph.blocks())
    checkpoints = [ck for ck in opts.checkpoint if ck != "selective" or attn]
    combos = Combos([(lam, z, ck) for lam in opts.lambdas for z in opts.zero
                     for ck in checkpoints])
    combos += [(coherent, z, ck) for coherent in lib.coherent() for z in opts.zero
               for ck in checkpoints]
    kinds = list(dict.fromkeys(ms.layer_kind))
    n_blocks = sum(ms.is_block)
    max_stages = max(1, min(opts.max_stages, len(units) - 1, v_units))
    # ranks sharing CPU cores: the exact price composes the step for them (bubbles cost
    # little, overlap hides nothing), which the tables' latencies do not rank by; price them
    # all (a CPU cluster's candidates are few)
    limit = None if ev.composer is not None else opts.exact_candidates
    counts = micro_batch_counts(global_batch, opts, v_units)
    found_of: dict[int, list[Candidate]] = {}
    ranked = Ranked(limit, _mixed_recompute) if limit and opts.prune_micro_batches else None
    pruned: list[int] = []
    dp_runs = 0
    # the most micro-batches first (the smallest bubbles, usually the fastest pipelines), so
    # that the bound of prune.py can skip the counts that cannot be priced
    for m in sorted(counts, reverse=ranked is not None):
        mb = global_batch // m
        found_of[m] = candidates = []
        # balanced pipelines of pp equal submeshes of n units, every schedule: their chunks
        # are priced with the stage DP's ranges on the same meshes (SharedRows)
        balanced = {v_units // pp: (pp, *_balanced_chunks(ms, pp, m, opts, n_blocks))
                    for pp in divisors(v_units) if pp <= min(max(n_blocks, 1), max_stages)}
        meshes_of: dict[int, list[LogicalMesh]] = {}
        for n in sizes:
            meshes_of[n] = submesh_shapes(n * per_unit, dpn)
            for mesh in meshes_of[n]:
                for k in kinds:
                    ws.kind_table(k, mesh, mb)
        tables = {(k, mesh): ws.tables[(k, mesh, mb)]
                  for n in sizes for mesh in meshes_of[n] for k in kinds}
        if ranked is not None and ranked.best:
            usable = dict(tables)            # every mesh m's pipelines may use
            for n in balanced:
                for mesh in submesh_shapes(n * per_unit, dpn):
                    for k in kinds:
                        usable[(k, mesh)] = ws.kind_table(k, mesh, mb)
            if ranked.beaten(latency_lower_bound(ev, usable, m, cluster.world_size,
                                                 memory, modes=checkpoints)):
                pruned.append(m)
                continue
        arrays = ws.layer_arrays(mb)
        shared = SharedRows(ev, mb, m, combos, arrays,
                            {n * per_unit: (a, b) for n, (_, _, _, a, b) in balanced.items()})
        # the stage DP
        stage_time = np.full((max_stages + 1, len(units) - 1, len(units), v_units + 1),
                             math.inf)
        rts = {}
        for n in sizes:
            rt = range_table(ev, meshes_of[n], mb, m, units, max_stages, tables, arrays,
                             combos=combos, memory=memory, priced=shared)
            rts[n] = rt
            stage_time[:, :, :, n] = rt.time
        # 1F1B with at most m stages (torch's Schedule1F1B refuses more); with more stages
        # than micro-batches every stage holds all m in flight, as GPipe does: the tables'
        # row for position m prices each stage so, and such pipelines are written as GPipe
        runs = [("1f1b", stage_time[:min(max_stages, m) + 1], lambda s: s)]
        if m < max_stages:
            gpipe = np.broadcast_to(stage_time[m], stage_time.shape).copy()
            gpipe[0] = math.inf
            runs.append(("gpipe", gpipe, lambda s: m))
        found = math.inf
        for schedule, table, row in runs:
            # GPipe holds more than 1F1B for the same latency: only a faster one is news
            res = pipeline_dp(table, v_units, m, bound=found)
            dp_runs += 1
            found = min(found, res.latency if res is not None else math.inf)
            if res is None or (schedule == "gpipe" and len(res.stages) <= m):
                continue                       # (1F1B holds less for the same time)
            stages = []
            for p in res.stages:
                rt = rts[p.devices]
                ci = int(rt.combo[row(p.position), p.start, p.end])
                mi = int(rt.mesh[row(p.position), p.start, p.end])
                stages.append(_stage(ms, rt.meshes[mi], rt.combos[ci], rt.choice[(mi, ci)],
                                     tables, units[p.start], units[p.end]))
            candidates.append(Candidate(PipelineChoice(tuple(stages), mb, m, schedule, 1),
                                        res.latency, "stage DP"))
        # balanced pipelines, every schedule
        for n, (pp, plans, chunks_of, a, b) in balanced.items():
            if n not in meshes_of:
                meshes_of[n] = submesh_shapes(n * per_unit, dpn)
                for mesh in meshes_of[n]:
                    for k in kinds:
                        tables[(k, mesh)] = ws.kind_table(k, mesh, mb)
            best = _balanced(ev, ms, meshes_of[n], tables, shared, mb, m, pp, combos,
                             memory, plans, chunks_of, a, b)
            candidates.extend(best)
        if ranked is not None:
            ranked.add(candidates)
    # in ascending m, as found in that order: the sort below breaks ties as it always has
    candidates = [c for m in sorted(found_of) for c in found_of[m]]
    seconds["inter_op"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    if not candidates:
        raise InfeasibleError(_nothing_fits(ev, cluster, global_batch))
    candidates.sort(key=lambda c: c.estimate)
    priced: list[Candidate] = []
    seen = set()
    limit = len(candidates) if limit is None else limit
    for c in candidates:
        if c.choice in seen or _mixed_recompute(c.choice):
            continue
        seen.add(c.choice)
        c.prediction = ev.predict(c.choice)
        if c.prediction.memory.total <= c.prediction.memory_limit_bytes:
            priced.append(c)
        if len(seen) >= limit:
            break
    if not priced:
        raise InfeasibleError(_nothing_fits(ev, cluster, global_batch))
    priced.sort(key=lambda c: (c.prediction.step_time_s, c.prediction.memory.total))
    seconds["exact"] = time.perf_counter() - t3
    seconds["total"] = time.perf_counter() - t0
    best = priced[0]
    stats = {"kinds": len(kinds), "layers": len(ms.layer_kind), "units": len(units) - 1,
             "device_units": v_units, "devices_per_unit": per_unit, "submesh_sizes": sizes,
             "micro_batch_counts": counts, "pruned_micro_batch_counts": sorted(pruned),
             "dp_runs": dp_runs, "candidates": len(candidates),
             "ilp_solves": len(lib.solves),
             "layouts": {k: len(v) for k, v in lib.layouts.items()},
             "uncovered_ops": [f"{k}:{n} ({op})" for k, n, op, _ in ms.uncovered()]}
    log.info("search: %s in %.2f s (%s)", best.choice, seconds["total"], seconds)
    return SearchResult(best.choice, best.prediction, priced, ev, ms, lib, seconds, stats)


def _stage(ms: ModelStructure, mesh: LogicalMesh, combo, pick: dict[str, int], tables,
           start: int, end: int) -> StageChoice:
    _, z, ck = combo
    present = list(dict.fromkeys(ms.layer_kind[start:end]))
    choice = tuple((k, tables[(k, mesh)].layouts[pick[k]]) for k in present)
    return StageChoice(start, end, mesh, choice, z, ck is True,
                       selective=ck == "selective", op_level=ck == "op")


def _mixed_recompute(p: PipelineChoice) -> bool:
    """Stages recomputing in two different ways (full beside selective, say): a plan names
    one mode for its recomputed layers (``parallel.checkpoint``), so such a choice is not
    written."""
    return len({st.recompute for st in p.stages} - {"none"}) > 1


def _balanced_chunks(ms: ModelStructure, pp: int, m: int, opts: SearchOptions,
                     n_blocks: int) -> tuple[list[tuple[str, int]], dict, np.ndarray,
                                             np.ndarray]:
    """The balanced pipelines on ``pp`` equal submeshes: (schedule, v) pairs, the chunks
    of each v (:func:`split_layers`), and every chunk range of every v, sorted, as
    (starts, ends) arrays."""
    plans = [("1f1b", 1)] if pp == 1 else [(s, 1) for s in ("1f1b", "gpipe")
                                           if runs_micro_batches(s, pp, m)]
    if pp > 1 and m % pp == 0:
        plans += [("interleaved_1f1b", v) for v in opts.virtual_stages
                  if pp * v <= n_blocks]
    chunks_of = {v: split_layers(ms.graph, pp * v) for _, v in plans}
    spans = sorted({c for chunks in chunks_of.values() for c in chunks})
    return (plans, chunks_of, np.array([c[0] for c in spans], dtype=np.int64),
            np.array([c[1] for c in spans], dtype=np.int64))


def _balanced(ev: Evaluator, ms: ModelStructure, meshes, tables, priced: SharedRows,
              mb: int, m: int, pp: int, combos, memory: float, plans, chunks_of,
              a: np.ndarray, b: np.ndarray) -> list[Candidate]:
    """The fastest fitting balanced pipeline per schedule on ``pp`` equal submeshes
    (``plans``, ``chunks_of``, chunk ranges [a, b): :func:`_balanced_chunks`)."""
    kinds = list(dict.fromkeys(ms.layer_kind))
    # every chunk range of every v, priced at once per (mesh, layouts, z, recomputation)
    where = {c: i for i, c in enumerate(zip(a.tolist(), b.tolist()))}
    best: dict[tuple[str, int], tuple[float, float, LogicalMesh, tuple, dict]] = {}
    # chunk c on rank c % pp: row r of a (v, pp) matrix holds chunks r pp .. r pp + pp - 1
    grid = {v: np.array([where[c] for c in chunks_of[v]]).reshape(v, pp) for _, v in plans}
    flight = {(sched, v): _in_flight(sched, pp, m, v) for sched, v in plans}
    for mesh in meshes:
        kt = {k: tables.get((k, mesh)) for k in kinds}
        if any(t is None for t in kt.values()):
            continue
        rows, rc, picks = priced(mesh, kt, a, b)
        if not rows:
            continue
        for sched, v in plans:
            lat, key = _balanced_latency(rc, grid[v], v, m, flight[(sched, v)], memory,
                                         solver_state_weight(ev.step.gpu))
            # the fastest; of equal ones the least memory (tables.tie_key), then the first
            # in combo order; an earlier mesh on a full tie
            r = int(np.lexsort((key, lat))[0])
            if np.isfinite(lat[r]) and ((sched, v) not in best or
                                        (lat[r], key[r]) < best[(sched, v)][:2]):
                best[(sched, v)] = (float(lat[r]), float(key[r]), mesh, combos[rows[r]],
                                    picks[rows[r]])
    out = []
    for (sched, v), (lat, _, mesh, combo, pick) in best.items():
        stages = tuple(_stage(ms, mesh, combo, pick, tables, ca, cb)
                       for ca, cb in chunks_of[v])
        out.append(Candidate(PipelineChoice(stages, mb, m, sched, v), lat, "balanced"))
    return out


def _in_flight(schedule: str, pp: int, m: int, v: int) -> "np.ndarray | list[np.ndarray]":
    """What each pipeline rank holds at its peak: for one chunk a rank, the stage
    micro-batches in flight (:func:`~autoplan.cost.memory.in_flight_micro_batches`, an array
    over ranks); interleaved, per rank the per-chunk counts of forwards not yet run backward
    at the moments that can be its peak (:func:`autoplan.schedule.live_chunks`, an array of
    shape (vectors, v)), so that chunks holding different layers are weighted as the
    schedule holds them -- what :class:`~autoplan.cost.step.StepModel` prices the plan with
    (:func:`~autoplan.cost.memory.in_flight_weighted`)."""
    if v == 1:
        return np.array([in_flight_micro_batches(schedule, pp, d, m, v) for d in range(pp)])
    return [np.array(live_chunks(schedule, pp, d, m, v), dtype=float) for d in range(pp)]


def _balanced_latency(rc, grid: np.ndarray, v: int, m: int,
                      flight: "np.ndarray | list[np.ndarray]", memory: float,
                      weight: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Pipeline latency of the chunks in ``grid`` (columns of ``rc``'s rows; grid column d:
    the chunks of rank d) for every row of ``rc``; ``flight``: what each rank holds at its
    peak (:func:`_in_flight`); inf where a rank runs out of memory (its states at ``weight``:
    :func:`~autoplan.cost.memory.solver_state_weight`). Sums over ranks run in rank order. Also
    each row's tie key: the largest of its ranks' :func:`~autoplan.planner.search.tables.
    tie_key`."""
    states = weight * rc.states[:, grid].sum(axis=1)           # (R, pp)
    chunk_act = rc.act[:, grid]                                # (R, v, pp)
    act = chunk_act.sum(axis=1)
    fixed = rc.fixed[:, grid].max(axis=1)
    if isinstance(flight, list):        # interleaved: the peak of sum_c live_c act_c per rank
        held = np.stack([(chunk_act[:, :, d] @ live.T).max(axis=1)
                         for d, live in enumerate(flight)], axis=1)
    else:
        held = flight * act
    fits = ~(states + held + fixed > memory).any(axis=1)
    dev_t = (rc.t[:, grid] + rc.send[grid]).sum(axis=1)        # (R, pp)
    slow = dev_t.max(axis=1)
    pp = grid.shape[1]
    if v == 1:
        pipe = np.cumsum(dev_t, axis=1)[:, -1] + (m - 1) * slow
    else:
        pipe = m * slow + (pp - 1) * slow / v
    lat = pipe + rc.u[:, grid].sum(axis=1).max(axis=1)
    return np.where(fits, lat, INF), tie_key(states, act, fixed).max(axis=1)


def _nothing_fits(ev: Evaluator, cluster: Cluster, global_batch: int) -> str:
    gb = 1e9
    psi = ev.graph.num_params
    need = psi * sum(ev.cm.state_bytes) / cluster.world_size
    return (f"no plan fits: even fully sharded (ZeRO-3 over all {cluster.world_size} "
            f"devices) the model states alone need {need / gb:.1f} GB per device, plus "
            f"activations, and a {cluster.device.name} has "
            f"{cluster.device.memory_bytes / gb:.1f} GB; use more devices, a smaller "
            f"global batch ({global_batch}) or activation checkpointing")
