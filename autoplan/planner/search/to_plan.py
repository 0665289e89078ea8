"""A search result as a :class:`~autoplan.plan.Plan` (format version 2).

The plan says, self-contained, what the engine must build (:mod:`autoplan.plan`):

* ``layout="uniform"`` when every pipeline rank has the same logical mesh and ZeRO stage:
  the version-1 mesh ``(pp, dp, tp)`` with the search's axis 0 as ``dp`` and axis 1 (inside a
  node) as ``tp``, so the current engine can run it when its placements are ones it
  supports; otherwise ``layout="stages"``, each stage on its own submesh with axes
  ``a0``, ``a1``.
* every parameter's placement on its stage's axes when it is computed with (what its reading
  op's strategy gives it); ZeRO is the stage's ``zero``, applied by the engine along the
  stage's data axes (:mod:`engine.zero`), not written into the placements;
* per stage: ZeRO stage, data axes, micro-batch per data-parallel rank, recomputed layers,
  the placement of every op the search chose (others follow their input), and the stage's
  predicted seconds and bytes per micro-batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import autoplan
from autoplan.placement import to_plan_text
from autoplan.plan import MeshSpec, ParallelConfig, Plan, Stage
from autoplan.plan_parts import PARTIAL_RECOMPUTE, RECOMPUTE_LABELS
from autoplan.planner.search.costs import BUCKETS, param_spec, member_choice
from autoplan.planner.search.evaluate import PipelineChoice, StageChoice
from autoplan.planner.search.kinds import members
from autoplan.planner.search.search import SearchResult

GB = 1e9


def choice_label(p: PipelineChoice) -> str:
    """Short label, e.g. '2 stages [64x2 z2, 64x2 z2] mb128x12 interleaved_1f1b v4'."""
    per = [" ".join(filter(None, (st.mesh.label(), f"z{st.zero}",
                                  RECOMPUTE_LABELS[st.recompute])))
           for st in p.stages[:p.pp]]
    if len(set(per)) == 1:
        stages = f"{p.pp} x [{per[0]}]"
    else:
        stages = "[" + ", ".join(per[:6]) + (", ..." if len(per) > 6 else "") + "]"
    sched = p.schedule + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")
    return f"{stages} mb{p.micro_batch}x{p.num_micro_batches} {sched}"


def _uniform(p: PipelineChoice) -> bool:
    first = p.stages[0]
    return all(st.mesh.shape == first.mesh.shape and st.zero == first.zero
               for st in p.stages) and p.micro_batch % first.mesh.shape[0] == 0


def _recompute_mode(p: PipelineChoice) -> str:
    """``parallel.checkpoint`` of a searched plan: 'selective' or 'op' when its recomputed
    stages recompute the attention core or op by op (the search never mixes two modes),
    'full' when every stage recomputes its blocks, else 'none' (some stages'
    ``checkpoint_layers`` then say which are recomputed fully)."""
    for mode in PARTIAL_RECOMPUTE:
        if any(st.recompute == mode for st in p.stages):
            return mode
    return "full" if all(st.checkpoint for st in p.stages) else "none"


def _sequence_parallel(result: SearchResult, st: StageChoice, micro_batch: int) -> bool:
    """Does the stage shard the residual stream of its blocks along the sequence on axis 1
    (Megatron-LM's sequence parallelism)?"""
    ev, ms = result.evaluator, result.structure
    graph = ms.graph
    for kind, ch in st.choice:
        kc = ev.kind_costs(kind, st.mesh, micro_batch)
        if not ms.is_block[kc.kg.layer]:
            continue
        names = graph.layers[kc.kg.layer].nodes
        for ai, a in enumerate(kc.anchors):
            node = graph.nodes[names[a]]
            spec = kc.kg.ops[a].strategies[kc.cand[ai][ch[ai]]].outputs[0]
            if node.tp_role == "replicated" and spec is not None and spec[1] == "S1" and \
                    len(node.output_meta[0].shape) >= 3:
                return True
    return False


def _param_and_activation_placements(result: SearchResult, st: StageChoice, micro_batch: int,
                                     axis_names: tuple[str, ...]
                                     ) -> tuple[dict, dict, tuple[str, ...]]:
    ev, ms = result.evaluator, result.structure
    graph = ms.graph
    params: dict[str, dict[str, str]] = {}
    acts: dict[str, dict[str, str]] = {}
    data_axes: set[int] = set()
    for kind, ch in st.choice:
        kc = ev.kind_costs(kind, st.mesh, micro_batch)
        kg = kc.kg
        rep_names = graph.layers[kg.layer].nodes
        spec_of_param: dict[str, tuple[str, ...]] = {}
        for ai, a in enumerate(kc.anchors):
            k = int(kc.cand[ai][ch[ai]])
            p = kc.psi[ai][ch[ai]]
            for b, axes in enumerate(BUCKETS):
                if p[b] > 0:
                    data_axes.update(axes)
            for pos in members(kg, a):
                s = kg.ops[pos].strategies[member_choice(kg, pos, k)]
                for q, src in enumerate(kg.ops[pos].inputs):
                    fqn, pspec = param_spec(kg, src, s.inputs[q])
                    if fqn is not None and pspec is not None:
                        spec_of_param.setdefault(fqn, pspec)
        for l in range(st.start, st.end):
            if ms.layer_kind[l] != kind:
                continue
            names = graph.layers[l].nodes
            # this layer's parameter names, by position against the representative layer
            rename: dict[str, str] = {}
            for pos, rep in enumerate(rep_names):
                rn, ln = graph.nodes[rep].params, graph.nodes[names[pos]].params
                rename.update(zip(rn, ln))
            for fqn, pspec in spec_of_param.items():
                mine = rename.get(fqn, fqn if l == kg.layer else None)
                if mine is None or mine not in graph.params:
                    continue
                params[mine] = {ax: to_plan_text(pl) for ax, pl in zip(axis_names, pspec)}
            for ai, a in enumerate(kc.anchors):
                spec = kg.ops[a].strategies[kc.cand[ai][ch[ai]]].outputs[0]
                if spec is not None:
                    acts[names[a]] = {ax: to_plan_text(pl)
                                      for ax, pl in zip(axis_names, spec)}
    data = tuple(axis_names[a] for a in sorted(data_axes) if st.mesh.shape[a] > 1)
    return params, acts, data


def build_search_plan(result: SearchResult, spec, cluster, *, global_batch: int,
                      seq_len: int | None, precision: dict[str, str], top_k: int = 10,
                      comparison: dict[str, Any] | None = None) -> Plan:
    """The :class:`Plan` of ``result.best`` (module docstring)."""
    p = result.best
    ev, ms = result.evaluator, result.structure
    graph = ms.graph
    cluster_dict = cluster.to_dict()
    device_type = cluster.device_type
    uniform = _uniform(p)
    first = p.stages[0]
    world = sum(p.stages[d].mesh.size for d in range(p.pp))
    if uniform:
        a0, a1 = first.mesh.shape
        axis_names = ("dp", "tp")
        sp = a1 > 1 and _sequence_parallel(result, first, p.micro_batch)
        parallel = ParallelConfig(dp=a0, tp=a1, pp=p.pp, zero=first.zero, sequence_parallel=sp,
                                  micro_batch=p.micro_batch // a0,
                                  num_micro_batches=p.num_micro_batches, schedule=p.schedule,
                                  virtual_stages=p.virtual_stages,
                                  checkpoint=_recompute_mode(p))
        mesh = MeshSpec(shape=(p.pp, a0, a1), device_type=device_type)
    else:
        axis_names = ("a0", "a1")
        parallel = ParallelConfig(dp=1, tp=1, pp=p.pp, zero=max(s.zero for s in p.stages),
                                  micro_batch=p.micro_batch,
                                  num_micro_batches=p.num_micro_batches, schedule=p.schedule,
                                  virtual_stages=p.virtual_stages,
                                  checkpoint=_recompute_mode(p))
        mesh = MeshSpec(shape=(world,), axis_names=("rank",), device_type=device_type)
    offsets = ev.rank_offsets(p)
    layer_names = [layer.name for layer in graph.layers]
    stages: list[Stage] = []
    param_placements: dict[str, dict[str, str]] = {}
    n = len(p.stages)
    for c, st in enumerate(p.stages):
        d = c % p.pp
        ranks = tuple(range(offsets[d], offsets[d] + st.mesh.size))
        params, acts, data = _param_and_activation_placements(result, st, p.micro_batch,
                                                              axis_names)
        param_placements.update(params)
        names = tuple(layer_names[st.start:st.end])
        ckpt = tuple(nm for l, nm in zip(range(st.start, st.end), names)
                     if st.recompute != "none" and ms.is_block[l])
        split = math.prod(st.mesh.shape[axis_names.index(a)] for a in data) if data else 1
        nxt = (c + 1) % p.pp
        cross = c == n - 1 or ev.cross_node(offsets[d], st.mesh.size, offsets[nxt],
                                        p.stages[c + 1].mesh.size)
        sc = ev.stage_cost(st, p.micro_batch, last=c == n - 1, cross_node=cross)
        predicted = {"compute_s": float(sc.fwd + sc.bwd),
                     "layer_comm_s": float(sc.tp_fwd + sc.tp_bwd),
                     "recompute_s": float(sc.fwd + sc.tp_fwd) if st.checkpoint
                     else float(sc.selective),
                     "send_s": float(2 * sc.send), "activation_bytes": float(sc.act),
                     "parameters_local": float(sum(b.count for b in sc.buckets)), "mesh": st.mesh.label()}
        stages.append(Stage(index=c, layers=(st.start, st.end), layer_names=names,
                            ranks=ranks, mesh_shape=tuple(st.mesh.shape),
                            checkpoint_layers=ckpt, axis_names=axis_names, zero=st.zero,
                            micro_batch=p.micro_batch // split
                            if p.micro_batch % split == 0 else None,
                            data_axes=data, activation_placements=acts, predicted=predicted))
    alternatives = [{"parallel": choice_label(c.choice), "origin": c.origin,
                     "step_time_s": float(c.prediction.step_time_s),
                     "mfu": float(c.prediction.mfu),
                     "memory_gb": float(c.prediction.memory.total / GB), "fits": True,
                     "time": c.prediction.time.to_dict()}
                    for c in result.ranked[1:top_k + 1]]
    # no timings here: the same inputs must give a byte-identical plan (they are in the
    # SearchResult, and the CLI prints them)
    planner = {"name": "auto", "label": choice_label(p), "stats": result.stats,
               "evaluated": len(result.ranked), "feasible": len(result.ranked),
               # without the clock: seconds taken and the CPU-budget share given (a
               # solve's status says whether its limit stopped it)
               "ilp": [{k: v for k, v in s.items() if k not in ("seconds", "time_limit_s")}
                       for s in result.library.solves],
               "explain": explain_placements(result)}
    plan = Plan(model=spec.to_dict(), model_fingerprint=spec.fingerprint(),
                num_params=graph.num_params, cluster=cluster_dict, global_batch=global_batch,
                seq_len=seq_len, mesh=mesh, parallel=parallel, stages=stages,
                param_placements=param_placements, precision=precision,
                prediction=result.prediction, alternatives=alternatives, planner=planner,
                created_by={"autoplan": autoplan.__version__,
                            "torch": torch.__version__.split("+")[0]},
                layout="uniform" if uniform else "stages", comparison=comparison or {})
    plan.validate()
    return plan


def explain_placements(result: SearchResult, *, per_op: int = 3) -> list[dict]:
    """Why each weight-reading op of the first stage holding each kind got its placement."""
    from autoplan.planner.search.explain import explain_stage

    out, seen = [], set()
    for c, st in enumerate(result.best.stages):
        kinds = [k for k, _ in st.choice if k not in seen]
        if not kinds:
            continue
        seen.update(kinds)
        out.extend(explain_stage(result, c, kinds=kinds, per_op=per_op))
    return out
