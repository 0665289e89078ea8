"""The uniform planner's layouts as restrictions of the intra-op ILP.

A uniform configuration (:class:`~autoplan.plan.ParallelConfig`: dp x tp, sequence
parallelism) is the placement space cut down to Megatron-LM's layout on a ``(dp, tp)``
logical mesh (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism):

* axis 0 (dp): every tensor with a batch dimension is sharded along it (``Shard(0)``, the
  batch or the flattened batch x sequence), every other tensor and every parameter is
  replicated;
* axis 1 (tp): a parameter with a tensor-parallel dim (``ParamInfo.tp_dim``, from the
  tracer's column/row roles) is ``Shard(tp_dim)``, every other parameter replicated; ops of
  the ``replicated`` role keep their outputs replicated — under sequence parallelism their
  (batch, sequence, hidden) outputs are sharded along the sequence (``Shard(1)``); in the
  layers before the first block (the embeddings) they may also stay replicated, as the
  engine's uniform runtime runs them (:mod:`engine.tensor_parallel`: the first block slices
  its input).

Within that space the ILP picks the cheapest consistent placement of everything else (the
activations between a column and a row op, the loss), which is Megatron's. The search
seeds its candidate layouts with these (so its space contains the uniform planner's), and
tests/test_search.py checks that the search's evaluator prices them exactly as the
Estimator does.
"""

from __future__ import annotations

import numpy as np

from autoplan.graph import OpGraph
from autoplan.planner.search.costs import KindCosts
from autoplan.planner.search.kinds import members


def megatron_restrict(graph: OpGraph, kc: KindCosts, *, sequence_parallel: bool,
                      replicated_embeddings: bool | None = None) -> list[np.ndarray]:
    """Per anchor of ``kc``: indices (into its candidate arrays) of the Megatron layouts.
    Under sequence parallelism the layers before the first block (the embeddings) run
    sequence-sharded (``replicated_embeddings=False``), replicated as the engine's uniform
    runtime runs them (``True``: the first block slices its input), or either (``None``)."""
    kg = kc.kg
    names = graph.layers[kg.layer].nodes
    dp, tp = kc.mesh.shape
    before_blocks = all(layer.name.startswith("<") for layer in graph.layers[:kg.layer + 1])
    modes: tuple[bool, ...] = (sequence_parallel,)
    if sequence_parallel and before_blocks:
        modes = {None: (True, False), True: (False,), False: (True,)}[replicated_embeddings]
    out = []
    for ai, a in enumerate(kc.anchors):
        ok = []
        for idx, k in enumerate(kc.cand[ai]):
            if any(all(_member_ok(graph, kg, names, pos, k, dp, tp, sp)
                       for pos in members(kg, a)) for sp in modes):
                ok.append(idx)
        out.append(np.array(ok, dtype=int))
    return out


def _member_ok(graph: OpGraph, kg, names, pos: int, k: int, dp: int, tp: int, sp: bool
               ) -> bool:
    info = kg.ops[pos]
    node = graph.nodes[names[pos]]
    s = info.strategies[k if kg.anchor_of[pos] == pos else kg.follow[pos][k]]
    tensors = list(zip(s.inputs, info.input_shapes, node.input_meta, info.inputs)) + \
        [(o, shp, meta, None) for o, shp, meta in zip(s.outputs, info.output_shapes,
                                                       node.output_meta)]
    for spec, probe, meta, src in tensors:
        if spec is None:
            continue
        is_param = src is not None and (src.kind == "param" or (
            src.kind == "op" and src.ref in kg.param_chain))
        batchy = tuple(probe) != tuple(meta.shape)
        if is_param:
            if spec[0] not in ("R", "P"):
                return False
            continue
        # (a size-1 axis carries only Replicate: no data parallelism when dp = 1)
        if spec[0] != ("S0" if batchy and dp > 1 else "R") and \
                not (src is None and spec[0] == "P"):
            return False                # (a Partial output: the loss summed over the batch)
    # parameters on the tp axis: as the tracer's roles say
    for q, src in enumerate(info.inputs):
        fqn = None
        if src.kind == "param":
            fqn = src.ref
        elif src.kind == "op" and src.ref in kg.param_chain:
            fqn = kg.param_chain[src.ref]
        if fqn is None:
            continue
        pinfo = graph.params.get(fqn)
        use = s.inputs[q][1]
        if src.kind == "op":          # through a view: map back to the parameter's dims
            back = [p for p, v in kg.param_chain_map[src.ref].items() if v == s.inputs[q]]
            if not back:
                return False
            use = back[0][1]
        want = f"S{pinfo.tp_dim}" if (tp > 1 and pinfo is not None and
                                      pinfo.tp_dim is not None) else "R"
        if use == "P":
            use = "R"
        if use != want:
            return False
    if node.tp_role == "replicated" and tp > 1:
        for o, probe, meta in zip(s.outputs, info.output_shapes, node.output_meta):
            if o is None:
                continue
            # sequence parallelism: (batch, sequence, hidden) activations sharded along the
            # sequence; flattened ones (the input of a column op) are gathered
            seq = sp and len(meta.shape) >= 3 and tuple(probe) != tuple(meta.shape)
            if o[1] != ("S1" if seq else "R") and o[1] != "P":
                return False            # (Partial: a row op's output, reduced downstream)
    return True


def uniform_choice(ev, parallel) -> "PipelineChoice":
    """The uniform configuration ``parallel`` (a :class:`~autoplan.plan.ParallelConfig`) as
    the search's :class:`~autoplan.planner.search.evaluate.PipelineChoice`: the Estimator's chunks
    (:func:`~autoplan.planner.build.split_layers`), each on a ``(dp, tp)`` mesh with the
    cheapest Megatron layout (the ILP restricted by :func:`megatron_restrict`; under
    sequence parallelism with the embeddings replicated, as the grid prices them)."""
    from autoplan.planner.build import split_layers
    from autoplan.planner.search.compose import Composition, build_problem
    from autoplan.planner.search.evaluate import PipelineChoice, StageChoice
    from autoplan.planner.search.intra_op import solve
    from autoplan.planner.search.mesh import LogicalMesh

    from autoplan.errors import InfeasibleError

    p = parallel
    if p.ep > 1 or p.cp > 1:
        # the search places ops on (dp, tp) meshes: expert and context parallelism are the
        # grid's alone, so such a configuration cannot be repriced (compare it directly)
        raise ValueError(f"{p.label()}: expert/context parallelism is not expressible as "
                         "per-op placements")
    ms = ev.ms
    graph = ms.graph
    mesh = LogicalMesh((p.dp, p.tp), ev.cm.cluster.devices_per_node)
    micro_batch = p.dp * p.micro_batch
    ckpt = p.checkpoint == "full"

    def build(replicated_embeddings: bool | None) -> PipelineChoice:
        stages = []
        for a, b in split_layers(graph, p.pp * p.virtual_stages):
            comp = Composition.of(ms, a, b)
            costs = {k: ev.kind_costs(k, mesh, micro_batch) for k, _ in comp.counts}
            restrict = {k: megatron_restrict(graph, costs[k],
                                             sequence_parallel=p.sequence_parallel,
                                             replicated_embeddings=replicated_embeddings)
                        for k, _ in comp.counts}
            problem, dec = build_problem(ev.cm, ms, comp, mesh, micro_batch,
                                         micro_batches=p.num_micro_batches, in_flight=1,
                                         checkpoint=ckpt, zero_allowed=(p.zero,),
                                         costs=costs, restrict=restrict)
            sol = solve(problem)
            choice = tuple((k, tuple(int(restrict[k][ai][sol.choice[dec.offset[k] + ai]])
                                     for ai in range(len(costs[k].anchors))))
                           for k, _ in comp.counts)
            stages.append(StageChoice(a, b, mesh, choice, p.zero, ckpt,
                                      selective=p.checkpoint == "selective",
                                      op_level=p.checkpoint == "op",
                                      tp_overlap=p.tp_comm_overlap is True))
        return PipelineChoice(tuple(stages), micro_batch, p.num_micro_batches, p.schedule,
                              p.virtual_stages)

    if not p.sequence_parallel or p.tp == 1:
        return build(None)
    # sequence parallelism: the embeddings replicated, as the engine's uniform runtime runs
    # them and the Estimator prices them (the first block slices its input)
    try:
        return build(True)
    except InfeasibleError:
        return build(None)
