"""Layer kinds: the graph of one representative layer, its ops grouped for the ILP.

Graph of a layer kind (:class:`KindGraph`): the ops, which tensor each input comes from
(another op of the layer, a parameter, the batch, or an earlier layer), and *followers*
(Alpa's merging): an op with one activation input from an op of the same layer whose every
strategy is determined by that input's placement (views, element-wise ops, dropout, ...)
joins its producer's group; where it admits no strategy for a sharded placement its producer
can give, it takes the nearest one with those axes replicated and the group pays the
all-gather (``KindGraph.reshard``); a Partial input it cannot take keeps it an anchor (an
all-reduce or a reduce-scatter is then the ILP's choice). A view of a parameter
(``t(weight)``) joins the parameter. Only group anchors become ILP variables.

The candidate strategies of each op come from :mod:`autoplan.planner.search.strategies` (DTensor's
registry asked on a probe mesh); this module wires them into a :class:`KindGraph`.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

from torch.utils import _pytree as pytree

from autoplan.cost.compute import op_kind
from autoplan.graph import OpGraph
from autoplan.planner.search.record import RecordedOp, Recording, TensorRef
from autoplan.planner.search.strategies import (AXES, Spec, Strategy, basic_specs, dtensor_strategies,
                                         replicate_strategy)


@dataclass(frozen=True)
class Source:
    """Where a tensor input of an op comes from (see :class:`~record.TensorRef`)."""

    kind: str                  # "op" (same layer), "param", "external" (earlier layer), "leaf"
    ref: int | str | None      # position of the producer in the layer / param FQN / global op
    output: int = 0


@dataclass
class OpInfo:
    pos: int                                 # position in the layer
    name: str                                # graph node name (of the representative)
    op: str
    inputs: list[Source]                     # per tensor input
    input_shapes: list[tuple[int, ...]]      # at the probe batch
    output_shapes: list[tuple[int, ...]]
    strategies: list[Strategy]
    covered: bool = True
    note: str = ""


@dataclass
class KindGraph:
    """One layer kind: its ops with strategies, groups (anchor -> followers)."""

    kind: str
    layer: int                               # representative layer index
    ops: list[OpInfo]
    anchor_of: list[int]                     # op position -> anchor position (self if anchor)
    follow: dict[int, dict[int, int]]        # follower pos -> {producer strategy -> own}
    param_chain: dict[int, str]              # op pos -> param FQN for views of a parameter
    param_chain_map: dict[int, dict[Spec, Spec]] = field(default_factory=dict)
    # op pos -> {param spec -> spec of the view}
    reshard: dict[int, dict[int, tuple[Spec, Spec]]] = field(default_factory=dict)
    # follower pos -> {anchor strategy -> (placement it receives, placement it needs)}

    @property
    def anchors(self) -> list[int]:
        return [i for i, a in enumerate(self.anchor_of) if a == i and i not in self.param_chain]

    @functools.cached_property
    def groups(self) -> dict[int, list[int]]:
        """Anchor position -> the positions of its group (itself and its followers, not
        parameter views), in order: built once (a kind is not changed once built), where a
        scan of every op per anchor made :func:`members` quadratic in the ops of a layer
        (thousands in a linear-attention layer's chunk loop)."""
        out: dict[int, list[int]] = {}
        for i, a in enumerate(self.anchor_of):
            if i not in self.param_chain:
                out.setdefault(a, []).append(i)
        return out


def flat_refs(op: RecordedOp) -> list[TensorRef]:
    is_ref = lambda x: isinstance(x, TensorRef)          # noqa: E731
    return [x for x in pytree.tree_leaves((op.args, op.kwargs), is_leaf=is_ref)
            if isinstance(x, TensorRef)]


def build_kind(mesh, graph: OpGraph, rec: Recording, layer: int,
               memo: dict | None = None) -> KindGraph:
    """The :class:`KindGraph` of ``graph.layers[layer]`` (module docstring). Positions are
    positions in the layer's node list; traced ops the re-run did not see
    (``Recording.unmatched``) are replicated and joined to nothing. ``memo``: DTensor's
    answers shared by the kinds of one probe mesh (:func:`~autoplan.planner.search.
    strategies.dtensor_strategies`)."""
    names = graph.layers[layer].nodes
    by_name = {op.name: op for op in rec.ops[layer]}
    pos_of = {graph_index: k for k, graph_index in
              enumerate(_global_indices(graph, layer))}
    infos: list[OpInfo] = []
    for k, name in enumerate(names):
        op = by_name.get(name)
        node = graph.nodes[name]
        if op is None:
            n_in, n_out = len(node.input_meta), len(node.output_meta)
            infos.append(OpInfo(k, name, node.op, [Source("leaf", "unmatched")] * n_in,
                                [m.shape for m in node.input_meta],
                                [m.shape for m in node.output_meta],
                                [replicate_strategy(n_in, n_out)], False,
                                "not seen when re-run at the probe batch"))
            continue
        refs = flat_refs(op)
        sources = []
        for r in refs:
            if r.kind == "op" and r.source in pos_of:
                sources.append(Source("op", pos_of[r.source], r.output))
            elif r.kind == "op":
                sources.append(Source("external", r.source, r.output))
            elif r.kind == "param":
                sources.append(Source("param", r.source))
            else:
                sources.append(Source("leaf", r.kind))
        note = ""
        try:
            strats = dtensor_strategies(mesh, op, memo=memo)
        except Exception as exc:          # a strategy function that cannot take the probe
            strats = None
            note = f"{type(exc).__name__}: {str(exc)[:120]}"
        if strats:
            # Partial inputs: for parameters (stored replicated; R -> P is free), and for
            # views, which pass a partial sum on to where it is reduced
            is_view = op_kind(node) == "view"
            strats = [s for s in strats if all(
                "P" not in spec or src.kind == "param" or
                (src.kind == "op" and src.ref in _chained(infos, src.ref)) or
                (is_view and all(o is None or o[a] == "P" for o in s.outputs
                                 for a in range(AXES) if spec[a] == "P"))
                for spec, src in zip(s.inputs, sources))]
        covered = bool(strats)
        if not strats:
            strats = [replicate_strategy(len(refs), len(op.outputs))]
            note = note or "not in DTensor's strategy registry"
        infos.append(OpInfo(k, op.name, str(op.func), sources, [r.shape for r in refs],
                            [o.shape for o in op.outputs], strats, covered, note))
    _keep_strided_for_bmm(infos)
    _strided_passes(mesh, infos, by_name, graph, memo=memo)
    anchor_of, follow, chain, chain_map, reshard = _groups(infos)
    return KindGraph(graph.layers[layer].kind, layer, infos, anchor_of, follow, chain,
                     chain_map, reshard)


#: ops asked again with strided inputs: batched matmuls and the views around them (the path
#: of eager attention's (batch x heads) flattening); element-wise ops run unflattened
_STRIDED_OPS = frozenset({"bmm", "baddbmm", "view", "_unsafe_view", "reshape", "expand",
                          "clone"})


_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "expand", "clone"})
_BMM = frozenset({"bmm", "baddbmm"})


def _keep_strided_for_bmm(infos: list[OpInfo]) -> None:
    """Strided outputs only where a batched matmul reads them through views (eager
    attention flattening batch x heads); elsewhere a view of a sharded inner dim gathers it
    (the sequence-parallel norm feeding a column-parallel projection)."""
    name = lambda i: infos[i].op.split(".")[1] if "." in infos[i].op else infos[i].op  # noqa
    feeders: set[int] = set()
    stack = [i for i in range(len(infos)) if name(i) in _BMM]
    while stack:
        i = stack.pop()
        for src in infos[i].inputs:
            if src.kind == "op" and name(src.ref) in _VIEWS and src.ref not in feeders:
                feeders.add(src.ref)
                stack.append(src.ref)
    for i, info in enumerate(infos):
        keep_leading = i in feeders
        info.strategies = [st for st in info.strategies if not any(
            "~" in p and not (keep_leading and p.startswith("S0~"))
            for spec in st.inputs + st.outputs if spec is not None for p in spec)] \
            or info.strategies


def _strided_passes(mesh, infos: list[OpInfo], by_name: dict, graph: OpGraph,
                    rounds: int = 2, memo: dict | None = None) -> None:
    """Strided shards (a flattened dim sharded along its inner factor: the heads inside
    batch x heads of eager attention) appear only as outputs of views; ask the registry
    again for the ops of ``_STRIDED_OPS`` that read them, with those placements as inputs,
    until none is new."""
    for _ in range(rounds):
        new = False
        for info in infos:
            op = by_name.get(info.name)
            if op is None or not info.covered or \
                    op.func.overloadpacket.__name__ not in _STRIDED_OPS:
                continue
            extra: dict[int, list[Spec]] = {}
            have = [{s.inputs[q] for s in info.strategies} for q in range(len(info.inputs))]
            for q, src in enumerate(info.inputs):
                if src.kind != "op":
                    continue
                given = {s.outputs[src.output] for s in infos[src.ref].strategies
                         if src.output < len(s.outputs) and s.outputs[src.output] is not None}
                # one strided axis (on the flattened leading dim), the other replicated or
                # batch-sharded: heads inside a flattened batch x heads (data x tensor
                # parallelism)
                strided = sorted(g for g in given if sum("~" in p for p in g) == 1
                                 and all(p.startswith("S0~") or p in ("R", "S0") for p in g)
                                 and g not in have[q])
                if strided:
                    extra[q] = strided
            if not extra:
                continue
            try:
                more = dtensor_strategies(mesh, op, extra, memo) or []
            except Exception:         # a rule that cannot take the strided placement
                continue
            is_view = op_kind(graph.nodes[info.name]) == "view"
            known = set(info.strategies)
            for s in more:
                if any("~" in p and not p.startswith("S0~") for spec in s.inputs + s.outputs
                       if spec is not None for p in spec):
                    continue
                if s in known or any("P" in spec and not (
                        src.kind == "param" or (is_view and all(
                            o is None or o[a] == "P" for o in s.outputs
                            for a in range(AXES) if spec[a] == "P")))
                        for spec, src in zip(s.inputs, info.inputs)):
                    continue
                info.strategies.append(s)
                known.add(s)
                new = True
        if not new:
            break


def _global_indices(graph: OpGraph, layer: int) -> list[int]:
    """Global op indices (positions in graph.nodes) of a layer's nodes."""
    start = sum(len(graph.layers[k].nodes) for k in range(layer))
    names = list(graph.nodes)
    first = names.index(graph.layers[layer].nodes[0]) if graph.layers[layer].nodes else start
    return list(range(first, first + len(graph.layers[layer].nodes)))


def _chained(infos: list[OpInfo], pos: int) -> set[int]:
    """{pos} if op ``pos`` only views a parameter (its inputs are one parameter or such a
    view), else the empty set."""
    info = infos[pos] if pos < len(infos) else None
    while info is not None and len(info.inputs) == 1:
        src = info.inputs[0]
        if src.kind == "param":
            return {pos}
        if src.kind != "op":
            return set()
        info = infos[src.ref]
    return set()


def _groups(infos: list[OpInfo]):
    """Followers (module docstring): anchor per op, the follower maps, parameter views."""
    anchor_of = list(range(len(infos)))
    follow: dict[int, dict[int, int]] = {}
    chain: dict[int, str] = {}
    chain_map: dict[int, dict[Spec, Spec]] = {}
    reshard: dict[int, dict[int, tuple[Spec, Spec]]] = {}
    for info in infos:
        acts = [j for j, s in enumerate(info.inputs) if s.kind in ("op", "external")]
        params = [j for j, s in enumerate(info.inputs) if s.kind == "param"]
        chained = [j for j in acts if info.inputs[j].kind == "op"
                   and info.inputs[j].ref in chain]
        # a view of a parameter (or of such a view): t(weight), weight.view(...)
        if len(info.inputs) == 1 and (params or chained):
            j = 0
            src = info.inputs[0]
            fqn = src.ref if src.kind == "param" else chain[src.ref]
            prev = (None if src.kind == "param" else chain_map[src.ref])
            mapping: dict[Spec, Spec] = {}
            by_in = {s.inputs[0]: s.outputs[0] for s in info.strategies}
            domain = basic_specs(len(info.input_shapes[0])) if prev is None else None
            if prev is None:
                for spec in domain:
                    if spec in by_in and by_in[spec] is not None:
                        mapping[spec] = by_in[spec]
            else:
                for pspec, vspec in prev.items():
                    if vspec in by_in and by_in[vspec] is not None:
                        mapping[pspec] = by_in[vspec]
            chain[info.pos] = fqn
            chain_map[info.pos] = mapping
            continue
        if len(acts) != 1 or params or info.inputs[acts[0]].kind != "op" or \
                len(info.inputs) != 1:
            continue
        src = info.inputs[acts[0]]
        anchor = anchor_of[src.ref]
        if src.ref in chain:
            continue
        by_in: dict[Spec, int] = {}
        ambiguous = False
        for k, s in enumerate(info.strategies):
            if s.inputs[0] in by_in:
                ambiguous = True
                break
            by_in[s.inputs[0]] = k
        if ambiguous:
            continue
        # every placement the producer can give this input must have a strategy here, or
        # one reached by replicating along some axes (the follower then all-gathers /
        # all-reduces its input first, e.g. a view that cannot keep a sequence shard)
        mapping: dict[int, int] = {}
        moves: dict[int, tuple[Spec, Spec]] = {}
        ok = True
        for k, s in enumerate(infos[anchor].strategies):
            p_spec = _output_spec(infos, follow, anchor, k, src.ref, src.output, anchor_of)
            if p_spec is None:
                ok = False
                break
            if p_spec in by_in:
                mapping[k] = by_in[p_spec]
                continue
            # (a Partial input is not followed: reducing it to Replicate or to a shard is a
            # real choice — sequence parallelism takes the shard — so the op stays an anchor)
            near = [f for f in by_in if all(f[a] == p_spec[a] or (f[a] == "R" and
                                                                 p_spec[a] != "P")
                                            for a in range(AXES))]
            if not near:
                ok = False
                break
            f = min(near, key=lambda f: (sum(x == "R" for x in f), f))
            mapping[k] = by_in[f]
            moves[k] = (p_spec, f)
        if not ok:
            continue
        anchor_of[info.pos] = anchor
        follow[info.pos] = mapping
        if moves:
            reshard[info.pos] = moves
    return anchor_of, follow, chain, chain_map, reshard


def member_strategy(kg: KindGraph, pos: int, anchor_choice: int) -> int:
    """Strategy index of op ``pos`` when its anchor picks ``anchor_choice``."""
    return _member(kg.ops, kg.follow, kg.anchor_of, pos, anchor_choice)


def _member(infos, follow, anchor_of, pos: int, k: int) -> int:
    """Follower maps are keyed by the *anchor's* strategy, so no recursion is needed."""
    return k if anchor_of[pos] == pos else follow[pos][k]


def _output_spec(infos, follow, anchor: int, k: int, pos: int, output: int,
                 anchor_of) -> Spec | None:
    """Placement of output ``output`` of op ``pos`` when ``anchor`` picks strategy ``k``."""
    s = infos[pos].strategies[_member(infos, follow, anchor_of, pos, k)]
    return s.outputs[output] if output < len(s.outputs) else None


def output_spec(kg: KindGraph, pos: int, output: int, anchor_choice: int) -> Spec | None:
    return _output_spec(kg.ops, kg.follow, kg.anchor_of[pos], anchor_choice, pos, output,
                        kg.anchor_of)


def members(kg: KindGraph, anchor: int) -> list[int]:
    """The positions of ``anchor``'s group (:attr:`KindGraph.groups`)."""
    return list(kg.groups.get(anchor, ()))
