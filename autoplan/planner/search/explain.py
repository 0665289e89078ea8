"""Why was this placement chosen? Each op group priced against its alternatives.

For a stage of a search result, the intra-op ILP of that stage (:func:`~autoplan.planner.
search.compose.build_problem`: its layers, logical mesh, micro-batches, ZeRO stage, recomputation
and memory budget) is rebuilt, the chosen layouts are written as its solution, and
:func:`explain` prices every alternative placement of a group
with the rest held fixed: the difference in the step-time objective (compute, resharding,
gradient synchronisation, optimizer) and in memory per device, and whether it would fit.
"""

from __future__ import annotations

from autoplan.cost.memory import in_flight_micro_batches, solver_budget_bytes
from autoplan.planner.search.compose import Composition, build_problem
from autoplan.planner.search.intra_op import IntraOpProblem, Solution, objective
from autoplan.placement import short
from autoplan.planner.search.strategies import Strategy

GB = 1e9


def explain(problem: IntraOpProblem, solution: Solution, group: int) -> list[dict]:
    """Every alternative of ``group`` priced with the rest of ``solution`` fixed: its
    objective terms, memory and the difference to the chosen one (chosen first)."""
    rows = []
    base = objective(problem, solution.choice, solution.zero)
    for j in range(problem.sizes[group]):
        choice = list(solution.choice)
        choice[group] = j
        val = objective(problem, choice, solution.zero)
        rows.append({"candidate": j, "chosen": j == solution.choice[group],
                     "fits": val["memory"] <= problem.budget * (1 + 1e-9), **val,
                     "delta": val["total"] - base["total"]})
    rows.sort(key=lambda r: (not r["chosen"], r["total"]))
    return rows


def describe(strategy: Strategy) -> str:
    """Output <- inputs, one placement per mesh axis: '[S(0) S(1)] <- [S(0) R] [R S(1)]'
    (R Replicate, S(d) Shard(d), S~(d) a strided shard, P Partial)."""
    def spec(s) -> str:
        return "-" if s is None else "[" + " ".join(short(p) for p in s) + "]"
    ins = " ".join(spec(s) for s in strategy.inputs)
    return f"{spec(strategy.outputs[0] if strategy.outputs else None)} <- {ins}"


def explain_stage(result, stage: int, *, kinds: list[str] | None = None, per_op: int = 3,
                  only_weights: bool = True) -> list[dict]:
    """Rows for the op groups of ``stage`` (of ``kinds``): chosen placement, its objective
    terms, and the ``per_op`` best alternatives with their differences."""
    ev, ms = result.evaluator, result.structure
    p = result.best
    st = p.stages[stage]
    comp = Composition.of(ms, st.start, st.end)
    costs = {k: ev.kind_costs(k, st.mesh, p.micro_batch) for k, _ in comp.counts}
    in_flight = in_flight_micro_batches(p.schedule, p.pp, stage % p.pp, p.num_micro_batches,
                                        p.virtual_stages)
    problem, dec = build_problem(ev.cm, ms, comp, st.mesh, p.micro_batch,
                                 micro_batches=p.num_micro_batches, in_flight=in_flight,
                                 checkpoint=st.checkpoint, zero_allowed=(st.zero,),
                                 budget=solver_budget_bytes(ev.cm.memory_limit_bytes,
                                                            ev.step.gpu), costs=costs)
    choice = [0] * len(dec.groups)
    for kind, ch in st.choice:
        for ai, j in enumerate(ch):
            choice[dec.offset[kind] + ai] = j
    base = objective(problem, choice, st.zero)
    sol = Solution(choice, st.zero, base["total"], base["memory"])
    rows = []
    graph = ms.graph
    for g, (kind, ai) in enumerate(dec.groups):
        if kinds is not None and kind not in kinds:
            continue
        kc = costs[kind]
        a = kc.anchors[ai]
        info = kc.kg.ops[a]
        reads_params = kc.psi[ai].sum() > 0
        if only_weights and not reads_params:
            continue
        table = explain(problem, sol, g)
        chosen = table[0]
        alts = table[1:1 + per_op]
        strat = lambda j: info.strategies[kc.cand[ai][j]]            # noqa: E731
        rows.append({
            "stage": stage, "kind": kind, "layer": graph.layers[kc.kg.layer].name,
            "op": info.name, "aten": info.op, "module": graph.nodes[
                graph.layers[kc.kg.layer].nodes[a]].module_path,
            "chosen": describe(strat(chosen["candidate"])),
            "objective_s": float(chosen["total"]), "memory_gb": float(chosen["memory"] / GB),
            "alternatives": [{"placement": describe(strat(r["candidate"])),
                              "delta_s": float(r["delta"]),
                              "memory_delta_gb": float((r["memory"] - chosen["memory"]) / GB),
                              "fits": bool(r["fits"])} for r in alts],
        })
    return rows

