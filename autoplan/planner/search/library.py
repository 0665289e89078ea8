"""Candidate layouts per layer kind: what the intra-op ILP proposes, for the DP to place.

A *layout* is one strategy per op group of a kind (indices into
``KindGraph.ops[anchor].strategies``), independent of mesh sizes. The library holds, per
kind, the layouts that the intra-op ILP (:mod:`autoplan.planner.search.intra_op`) finds optimal
for the whole model on representative logical meshes:

* every ``(W / b, b)`` mesh over the whole cluster (W devices, b dividing the node size)
  and every ``(M / b, b)`` mesh of one node (on a one-node cluster also ``1 x 1``, a
  single-device stage's), at the micro-batch that gives each device about one sample;
* at memory weights lambda in ``LAMBDAS`` on the whole cluster, 0 on one node (seconds per
  byte: 0 is the fastest layout,
  larger ones trade time for memory — ZeRO-style sharding, tensor parallelism,
  sequence sharding; inf stands for 1 s per GB, which in practice minimises memory);
* plus the uniform planner's layouts (:mod:`autoplan.planner.search.megatron`: the ILP restricted
  to Megatron's placements for each TP degree, with and without sequence parallelism — with
  the embeddings sequence-sharded or replicated), so the search's space contains the
  uniform one.

Each solve is logged with its problem size and time (``Library.solves``).

Bounded time: the solves share :data:`ILP_BUDGET_S` seconds of CPU time (building each
ILP and CBC's solve, one thread; CBC's time limit is CPU time), handed out in order — whole-cluster meshes first, memory weight 0 first — so
solve ``i`` of ``n`` may run ``min(time_limit_s, left / (n - i))`` (at least
:data:`MIN_SOLVE_S`). A solve stopped by its limit contributes the best layout found so far
(status ``FEASIBLE`` in ``Library.solves``), not the proven optimum; small problems (one
block kind: every GPT-style model) solve to optimality well inside their share. Once the
budget is spent and the library holds a layout of every kind, the remaining solves are
skipped (``Library.skipped``): an ILP of hundreds of thousands of columns (a layer running
thousands of ops, as a linear-attention chunk loop does) costs seconds to build, export and
load whatever its solver's limit, and forty of them took minutes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from autoplan.errors import InfeasibleError
from autoplan.planner.search.compose import Composition, ModelStructure, build_problem
from autoplan.planner.search.evaluate import Evaluator
from autoplan.planner.search.intra_op import solve_weights
from autoplan.planner.search.megatron import megatron_restrict
from autoplan.planner.search.mesh import LogicalMesh

log = logging.getLogger(__name__)

#: memory weights (seconds per byte) of the library's ILP solves; inf: least memory
LAMBDAS = (0.0, 1e-11, math.inf)
#: CPU seconds all the library's solves share (module docstring): an encoder-decoder's
#: ILP (T5: 169 op groups, 45,889 pair variables on an 8 x 2 mesh) can take CBC minutes to
#: prove optimal, which kept T5 on 16 GPUs planning for 130 s (issue 15, item 7)
ILP_BUDGET_S = 20.0
#: the least solver time a solve gets once the budget is spent
MIN_SOLVE_S = 1.0


def ilp_weight(lam: float) -> float:
    """The ILP's memory weight for library weight ``lam`` (inf: 1 s per GB, least memory)."""
    return 1e-9 if not math.isfinite(lam) else lam


@dataclass
class Library:
    layouts: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    origin: dict[tuple[str, tuple[int, ...]], str] = field(default_factory=dict)
    solves: list[dict] = field(default_factory=list)

    solutions: list[tuple[tuple[str, tuple[int, ...]], ...]] = field(default_factory=list)
    unweighted: list[bool] = field(default_factory=list)     # solved at memory weight 0
    skipped: list[str] = field(default_factory=list)         # solves left out, budget spent

    def add(self, kind: str, layout: tuple[int, ...], origin: str) -> None:
        bucket = self.layouts.setdefault(kind, [])
        if layout not in bucket:
            bucket.append(layout)
            self.origin[(kind, layout)] = origin

    def coherent(self) -> list[tuple[tuple[str, tuple[int, ...]], ...]]:
        """The distinct whole-model solutions at memory weight 0 and Megatron's (one layout
        per kind, as one solve chose them together)."""
        return list(dict.fromkeys(sol for sol, keep in zip(self.solutions, self.unweighted)
                                  if keep))

    @property
    def seconds(self) -> float:
        return sum(s["seconds"] for s in self.solves)


def closest_divisor(n: int, target: int) -> int:
    """The divisor of ``n`` closest to ``target`` (the larger on a tie).

    Divisors come in pairs ``(d, n // d)`` with ``d <= sqrt(n)``, so trying ``d`` up to
    ``isqrt(n)`` finds them all: O(sqrt n) steps (46,341 at n = 2**31) instead of n."""
    if n < 1:
        raise ValueError(f"closest_divisor needs n >= 1, got {n}")
    divs = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            divs.update((d, n // d))
    return min(divs, key=lambda d: (abs(d - target), -d))


def library_meshes(world: int, devices_per_node: int, nodes: int = 0) -> list[LogicalMesh]:
    """The meshes the library solves on (module docstring); on one node also the 1 x 1
    mesh of a single-device stage, on which only replicated layouts are valid."""
    out = []
    sizes = {world, min(world, devices_per_node)}
    if nodes == 1:
        sizes.add(1)
    for devices in sorted(sizes, reverse=True):
        for b in range(1, devices_per_node + 1):
            if devices_per_node % b == 0 and devices % b == 0:
                out.append(LogicalMesh((devices // b, b), devices_per_node))
    return out


def build_library(ev: Evaluator, ms: ModelStructure, world: int, global_batch: int, *,
                  lambdas=LAMBDAS, backend: str = "CBC", time_limit_s: float = 30.0,
                  budget_s: float = ILP_BUDGET_S, megatron: bool = True) -> Library:
    """(module docstring) The solves share ``budget_s`` CPU seconds: solve ``i``
    of ``n`` may take ``max(MIN_SOLVE_S, min(time_limit_s, left / (n - i)))``."""
    lib = Library()
    graph = ms.graph
    comp = Composition.of(ms, 0, len(graph.layers))
    dpn = ev.cm.cluster.devices_per_node
    work = []
    for mesh in library_meshes(world, dpn, ev.cm.cluster.nodes):
        # one node of a larger cluster (a pipeline stage's submesh): the fastest layouts
        whole = mesh.size == world
        micro_batch = closest_divisor(global_batch, mesh.size)
        try:
            costs = {k: ev.kind_costs(k, mesh, micro_batch) for k, _ in comp.counts}
        except ValueError:            # an op with no placement valid on this mesh
            continue
        m = max(1, global_batch // micro_batch)
        runs = [(lam, None, f"ILP lambda={lam:g} on {mesh.label()}") for lam in lambdas
                if whole or lam == 0.0]
        if megatron:
            variants = [(False, None, "")]
            if mesh.shape[1] > 1:     # sequence parallelism, embeddings sharded or not
                variants += [(True, False, "+sp"), (True, True, "+sp (replicated embeddings)")]
            for sp, rep, tag in variants:
                restrict = {k: megatron_restrict(graph, costs[k], sequence_parallel=sp,
                                                 replicated_embeddings=rep)
                            for k, _ in comp.counts}
                if any(len(r) == 0 for rs in restrict.values() for r in rs):
                    continue
                runs.append((0.0, restrict, f"Megatron dp{mesh.shape[0]} tp{mesh.shape[1]}"
                                            + tag))
        work += [(mesh, micro_batch, m, costs, run) for run in runs]
    # the memory weights of one mesh change only the ILP's objective: one build each
    groups: list[list[int]] = []
    for i, (mesh, _, _, _, (_, restrict, _)) in enumerate(work):
        prev = work[groups[-1][0]] if groups else None
        if restrict is None and prev is not None and prev[0] == mesh and prev[4][1] is None:
            groups[-1].append(i)
        else:
            groups.append([i])
    spent = 0.0
    for gi, group in enumerate(groups):
        if spent >= budget_s and lib.layouts:
            lib.skipped = [work[i][4][2] for g in groups[gi:] for i in g]
            log.info("library: CPU budget of %.0f s spent; %d solves skipped", budget_s,
                     len(lib.skipped))
            break
        mesh, micro_batch, m, costs, (_, restrict, _) = work[group[0]]
        weights = [ilp_weight(work[i][4][0]) for i in group]
        t0, c0 = time.perf_counter(), time.process_time()
        problem, dec = build_problem(ev.cm, ms, comp, mesh, micro_batch, micro_batches=m,
                                     in_flight=1, checkpoint=False, mem_weight=weights[0],
                                     costs=costs, restrict=restrict)
        limits: list[float] = []

        def limit() -> float:
            i = group[len(limits)]
            limits.append(max(MIN_SOLVE_S, min(time_limit_s,
                                               (budget_s - spent) / (len(work) - i))))
            return limits[-1]

        solutions = solve_weights(problem, weights, time_limit_s=limit, backend=backend)
        for i in group:
            lam, _, origin = work[i][4]
            try:
                sol = next(solutions)
            finally:
                spent += time.process_time() - c0
            seconds = time.perf_counter() - t0
            t0, c0 = time.perf_counter(), time.process_time()
            if sol is None:           # (nothing fits this mesh at this memory weight)
                continue
            lib.solves.append({"mesh": mesh.label(), "micro_batch": micro_batch,
                               "origin": origin, "problem": problem.describe(),
                               "seconds": seconds, "status": sol.status,
                               "time_limit_s": limits[-1]})
            log.info("library: %s: %s in %.2f s", origin, problem.describe(), seconds)
            whole = []
            for kind, _ in comp.counts:
                kc = costs[kind]
                sel = (restrict or {}).get(kind)
                layout = []
                for ai in range(len(kc.anchors)):
                    j = sol.choice[dec.offset[kind] + ai]
                    j = int(sel[ai][j]) if sel is not None else j
                    layout.append(int(kc.cand[ai][j]))
                lib.add(kind, tuple(layout), origin)
                whole.append((kind, tuple(layout)))
            lib.solutions.append(tuple(whole))
            lib.unweighted.append(lam == 0.0)
    if not lib.layouts:
        raise InfeasibleError("no layout of the model's ops is valid on any mesh of this "
                              "cluster (the batch or the tensor dims do not divide)")
    return lib
