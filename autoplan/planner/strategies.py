"""Candidate placements of every op, from DTensor's own sharding-strategy registry.

For each op of a representative layer (:mod:`autoplan.planner.record`) this module asks
DTensor which placements the op admits on a 2-D device mesh, exactly as DTensor's sharding
propagator would: ``ShardingPropagator.op_strategy_funcs[op]`` (full-mesh strategy
functions) or ``op_single_dim_strategy_funcs[op]`` expanded over the mesh dims
(``_expand_single_dim_strategy_to_mesh``). The mesh is a 2 x 2 ``DeviceMesh`` on a fake
process group (``torch.testing._internal.distributed.fake_pg.FakeStore``, backend
``"fake"``): strategies are per mesh *axis*, so a 2 x 2 probe describes any (a, b) mesh;
divisibility by the real axis sizes is checked later (:func:`valid_on`).

A strategy (:class:`Strategy`) gives one placement per mesh axis for every tensor input and
output, written compactly: ``"R"`` (Replicate), ``"S<d>"`` (Shard(d)), ``"P"``
(Partial(sum)). Kept: strategies whose inputs are Replicate or Shard and whose outputs are
Replicate, Shard or Partial (Alpa's space: Partial inputs only for parameters — a
row-parallel bias — and for views, which pass a partial sum on; ``_StridedShard`` layouts are
dropped). Ops the registry does not cover (factory ops such as
``arange``), or whose strategy function fails on the probe, get one strategy: everything
replicated (``Strategy.covered`` is False; :mod:`autoplan.planner.explain` lists them).

Graph of a layer kind (:class:`KindGraph`): the ops, which tensor each input comes from
(another op of the layer, a parameter, the batch, or an earlier layer), and *followers*
(Alpa's merging): an op with one activation input from an op of the same layer whose every
strategy is determined by that input's placement (views, element-wise ops, dropout, ...)
joins its producer's group; where it admits no strategy for a sharded placement its producer
can give, it takes the nearest one with those axes replicated and the group pays the
all-gather (``KindGraph.reshard``); a Partial input it cannot take keeps it an anchor (an
all-reduce or a reduce-scatter is then the ILP's choice). A view of a parameter
(``t(weight)``) joins the parameter. Only group anchors become ILP variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils import _pytree as pytree

from autoplan.cost.compute import op_kind
from autoplan.graph import OpGraph
from autoplan.planner.record import RecordedOp, Recording, TensorRef

Place = str                    # "R" | "S<d>" | "P"
Spec = tuple[Place, ...]        # one placement per mesh axis
AXES = 2
REPLICATE: Spec = ("R",) * AXES


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Spec, ...]            # per tensor input (flattened argument order)
    outputs: tuple[Spec | None, ...]    # per output tensor (None: not a tensor / unknown)


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


# ---- the probe mesh -----------------------------------------------------------------------

@contextlib.contextmanager
def probe_mesh() -> Iterator["torch.distributed.device_mesh.DeviceMesh"]:
    """A 2 x 2 DeviceMesh on a fake process group; the group is torn down afterwards if this
    context created it. DTensor's redistribute-cost estimate is disabled meanwhile (not
    needed here, and the slowest part of enumerating strategies)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = False
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        created = True
    elif dist.get_world_size() < 4:
        raise RuntimeError("a process group of fewer than 4 ranks is already initialised; "
                           "plan in a process without one (the planner uses a fake group)")
    import torch.distributed.tensor._ops.utils as dt_utils

    # strategy functions price every input placement against every strategy with DTensor's
    # own redistribute cost (a graph search per pair for strided layouts); the planner
    # prices resharding itself, so those costs are switched off while probing
    saved = dt_utils.redistribute_cost
    dt_utils.redistribute_cost = _zero_cost
    try:
        yield DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("a0", "a1"))
    finally:
        dt_utils.redistribute_cost = saved
        if created:
            dist.destroy_process_group()


def _zero_cost(src, dst) -> float:
    return 0.0


# ---- placements ---------------------------------------------------------------------------

def place_str(p) -> Place | None:
    """DTensor placement -> compact form, None if outside the kept space."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return f"S{p.dim}~{p.split_factor}"
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P"            # sum or avg: the same collective resolves it
    return None


def shard_dim(p: Place) -> int | None:
    """The tensor dim a compact placement shards, or None."""
    if not p.startswith("S"):
        return None
    return int(p[1:].split("~")[0])


def dtensor_placement(p: Place) -> str:
    """Compact form -> the plan's DTensor spelling (a strided shard — a flattened dim
    sharded along its inner factor, e.g. heads inside batch x heads — is written
    ``_StridedShard(d)``)."""
    if p == "R":
        return "Replicate()"
    if p == "P":
        return "Partial()"
    if "~" in p:
        return f"_StridedShard({shard_dim(p)})"
    return f"Shard({shard_dim(p)})"


def basic_specs(ndim: int, partial: bool = False) -> list[Spec]:
    """Every Replicate/Shard(d) (and with ``partial``, Partial) combination over the mesh
    axes for an ndim-tensor."""
    opts = ["R"] + [f"S{d}" for d in range(ndim)] + (["P"] if partial else [])
    return [tuple(s) for s in itertools.product(opts, repeat=AXES)]


def _spec_of(spec) -> Spec | None:
    if spec is None:
        return None
    out = tuple(place_str(p) for p in spec.placements)
    return None if any(p is None for p in out) else out


# ---- DTensor calls ------------------------------------------------------------------------

def _dtensor_spec(mesh, ref: TensorRef, spec: Spec):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from torch.distributed.tensor import Partial

    from torch.distributed.tensor.placement_types import _StridedShard

    def one(p: Place):
        if p == "R":
            return Replicate()
        if p == "P":
            return Partial()
        if "~" in p:
            return _StridedShard(shard_dim(p), split_factor=int(p.split("~")[1]))
        return Shard(shard_dim(p))

    places = tuple(one(p) for p in spec)
    meta = TensorMeta(torch.Size(ref.shape), ref.stride, ref.dtype)
    return DTensorSpec(mesh, places, tensor_meta=meta)


def dtensor_strategies(mesh, op: RecordedOp,
                       extra: dict[int, list[Spec]] | None = None) -> list[Strategy] | None:
    """All strategies DTensor registers for ``op`` (None if the op is not covered).
    ``extra``: more placements (strided shards a producer gives) per tensor input slot."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    pure = _out_of_place(op.func)
    if pure is not None:
        # an in-place op's rule follows the placement ``self`` has at run time (one
        # strategy for the probe's seed): enumerate its out-of-place twin's, keeping those
        # that leave ``self``'s placement unchanged
        twin = dataclasses.replace(op, func=pure)
        strats = dtensor_strategies(mesh, twin, extra)
        if strats:
            return [s for s in strats if s.outputs and s.outputs[0] == s.inputs[0]]
    single = prop.op_single_dim_strategy_funcs.get(op.func)
    full = prop.op_strategy_funcs.get(op.func)
    if single is None and full is None:
        return None
    try:
        specs = _registry_specs(mesh, op, prop, single, full, extra or {}, None)
    except Exception:           # noqa: BLE001 — one extra placement the rule cannot take
        if not extra:
            raise
        specs = _registry_specs(mesh, op, prop, single, full, {}, None)
        for slot, extras in extra.items():
            for spec in extras:
                try:
                    specs += _registry_specs(mesh, op, prop, single, full, {slot: [spec]},
                                             None)
                except Exception:   # noqa: BLE001
                    continue
    if single is not None:
        # single-dim rules expand their shard placeholders into the shard kinds the inputs
        # use: one more call per strided placement a producer gives, seeding every input
        # that can receive it
        union = sorted({spec for extras in (extra or {}).values() for spec in extras})
        for spec in union:
            slots = {slot: spec for slot, extras in extra.items() if spec in extras}
            try:
                specs += _registry_specs(mesh, op, prop, single, full, {}, slots)
            except Exception:       # noqa: BLE001 — a rule that cannot take this placement
                continue
    if specs is None:
        return None
    specs = list(specs) + _supplement(mesh, op)
    is_ref = lambda x: isinstance(x, TensorRef)          # noqa: E731
    n_in = sum(1 for x in pytree.tree_leaves((op.args, op.kwargs), is_leaf=is_ref)
               if isinstance(x, TensorRef))
    n_out = len(op.outputs)
    out: list[Strategy] = []
    seen: set[Strategy] = set()
    for s in specs:
        outs = s.output_specs
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        o_specs = [_spec_of(o) if o is not None else None for o in outs]
        if any(o is None and raw is not None for o, raw in zip(o_specs, outs)):
            continue
        o_specs = (o_specs + [None] * n_out)[:n_out]
        if s.input_specs is None:
            i_specs = [o_specs[0]] * n_in
        else:
            i_specs = [_spec_of(i) for i in s.input_specs]
        if len(i_specs) != n_in or any(i is None for i in i_specs):
            continue
        strat = Strategy(tuple(i_specs), tuple(o_specs))
        if strat not in seen:
            seen.add(strat)
            out.append(strat)
    return out


def _out_of_place(func):
    """``aten.add_.Scalar`` -> ``aten.add.Scalar`` (None if ``func`` is not in place or has
    no such twin)."""
    name = func._schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, func._overloadname, None) if packet is not None else None


def _tuple_strategies(args):
    """A list argument of tensors (``cat``'s) as DTensor's propagator hands it to a strategy
    function: a ``TupleStrategy`` of their strategies."""
    from torch.distributed.tensor._op_schema import OpStrategy, TupleStrategy

    return tuple(TupleStrategy(tuple(a)) if isinstance(a, (list, tuple)) and a and
                 all(isinstance(x, OpStrategy) for x in a) else a for a in args)


def _registry_specs(mesh, op: RecordedOp, prop, single, full, extra: dict[int, list[Spec]],
                    seed_override: dict[int, Spec] | None) -> list:
    """OpSpecs from the registry. The runtime schema gets one spec per tensor (a sharded
    one, so that single-dim placeholders expand to Shard); the strategy schema every basic
    spec (plus ``extra``) for full-mesh functions, so that followers map each of them."""
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import \
        _expand_single_dim_strategy_to_mesh

    is_ref = lambda x: isinstance(x, TensorRef)          # noqa: E731
    counter = {"seed": 0, "cands": 0}

    def seed(r: TensorRef):
        slot = counter["seed"]
        counter["seed"] += 1
        if seed_override and slot in seed_override:
            return _dtensor_spec(mesh, r, seed_override[slot])
        return _dtensor_spec(mesh, r, ("S0", "R") if r.shape else REPLICATE)

    def cands(r: TensorRef):
        slot = counter["cands"]
        counter["cands"] += 1
        if single is not None:
            if seed_override and slot in seed_override:
                return OpStrategy([OpSpec(_dtensor_spec(mesh, r, seed_override[slot]))])
            return OpStrategy([OpSpec(_dtensor_spec(mesh, r, ("S0", "R") if r.shape
                                                    else REPLICATE))])
        # (no shard of a dim too small to split: some rules raise on it, e.g. a view that
        # drops the 1 x 1 of a pooled feature map)
        specs = [sp for sp in basic_specs(len(r.shape), partial=True)
                 if all(shard_dim(x) is None or r.shape[shard_dim(x)] >= 2 for x in sp)]
        specs += list(extra.get(slot, []))
        return OpStrategy([OpSpec(_dtensor_spec(mesh, r, s)) for s in specs])

    info = prop.op_to_schema_info.get(op.func)
    args = pytree.tree_map_only(TensorRef, seed, op.args, is_leaf=is_ref)
    kwargs = pytree.tree_map_only(TensorRef, seed, op.kwargs, is_leaf=is_ref)
    s_args = _tuple_strategies(pytree.tree_map_only(TensorRef, cands, op.args, is_leaf=is_ref))
    s_kwargs = pytree.tree_map_only(TensorRef, cands, op.kwargs, is_leaf=is_ref)
    schema = OpSchema(op.func, tuple(args), kwargs, schema_info=info)
    s_schema = OpSchema(op.func, tuple(s_args), s_kwargs, schema_info=info)
    if single is not None:
        out_meta = prop._propagate_tensor_meta_non_cached(schema)
        fn = _expand_single_dim_strategy_to_mesh(mesh, s_schema, single, out_meta)
        return list(getattr(fn(op.func, s_schema.args_meta, s_schema.kwargs_meta),
                            "strategies", None) or [])
    try:
        return list(getattr(full(s_schema), "strategies", None) or [])
    except (IndexError, AssertionError):
        # strategy functions that walk several inputs in lockstep (nll_loss_forward):
        # one call per placement of the first tensor input, the others given once
        plain = lambda r: _dtensor_spec(mesh, r, ("S0", "R") if r.shape else REPLICATE)  # noqa
        return _per_first_input(mesh, full, op, info, plain)


def _per_first_input(mesh, full, op: RecordedOp, info, seed) -> list:
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    is_ref = lambda x: isinstance(x, TensorRef)          # noqa: E731
    first = next(x for x in pytree.tree_leaves((op.args, op.kwargs), is_leaf=is_ref)
                 if isinstance(x, TensorRef))
    out = []
    for spec in basic_specs(len(first.shape)):
        def one(r: TensorRef, spec=spec):
            s = _dtensor_spec(mesh, r, spec) if r is first else seed(r)
            return OpStrategy([OpSpec(s)])
        s_args = pytree.tree_map_only(TensorRef, one, op.args, is_leaf=is_ref)
        s_kwargs = pytree.tree_map_only(TensorRef, one, op.kwargs, is_leaf=is_ref)
        try:
            result = full(OpSchema(op.func, tuple(s_args), s_kwargs, schema_info=info))
        except (IndexError, AssertionError, ValueError, RuntimeError):
            continue
        out.extend(getattr(result, "strategies", None) or [])
    return out


_BATCH_NORMS = frozenset({"native_batch_norm", "_native_batch_norm_legit",
                          "_native_batch_norm_legit_functional", "cudnn_batch_norm"})


def _supplement(mesh, op: RecordedOp) -> list:
    """Hand-written strategies for what the registry lacks. Batch norm over a batch sharded
    along a mesh axis, with per-replica statistics (DDP's semantics without SyncBatchNorm,
    which the uniform planner assumes too). The vocabulary-parallel loss of
    ``torch.distributed.tensor.parallel.loss_parallel`` (a context that swaps in its own
    op handlers rather than registering strategies). ``_log_softmax`` on a tensor sharded
    along the softmax dim stays sharded (its max and sum-exp need a small all-reduce of
    one value per row, not costed), and ``nll_loss_forward`` of such a tensor with
    replicated targets gives a partial sum."""
    from torch.distributed.tensor._op_schema import OpSpec

    name = op.func.overloadpacket.__name__
    refs = [x for x in pytree.tree_leaves((op.args, op.kwargs),
                                          is_leaf=lambda x: isinstance(x, TensorRef))
            if isinstance(x, TensorRef)]
    out = []
    if name == "_log_softmax" and refs:
        dim = op.args[1] % len(refs[0].shape)
        for other in ["R"] + [f"S{d}" for d in range(len(refs[0].shape)) if d != dim]:
            for axis in range(AXES):
                spec = [other] * AXES
                spec[axis] = f"S{dim}"
                if len(set(spec)) < AXES and "S" in other:
                    continue
                s = _dtensor_spec(mesh, refs[0], tuple(spec))
                out.append(OpSpec(output_specs=s, input_specs=(s,)))
    elif name in _BATCH_NORMS and refs and len(refs[0].shape) >= 2:
        # batch norm on a batch sharded along an axis, with per-replica statistics: what
        # DistributedDataParallel computes without SyncBatchNorm (DTensor has no rule for a
        # sharded batch, whose statistics would need a cross-replica reduction)
        for spec in (("S0", "R"), ("R", "S0"), ("S0", "S0")):
            ins = tuple(_dtensor_spec(mesh, r, spec if k == 0 else REPLICATE)
                        for k, r in enumerate(refs))
            outs = tuple(_dtensor_spec(mesh, o, spec if k == 0 else REPLICATE)
                         for k, o in enumerate(op.outputs))
            out.append(OpSpec(output_specs=outs if len(outs) > 1 else outs[0],
                              input_specs=ins))
    elif name == "nll_loss_forward" and len(refs) >= 2 and len(refs[0].shape) == 2:
        from torch.distributed.tensor import Partial, Replicate
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        for axis in range(AXES):
            for other in ("R", "S0"):
                x = ["R"] * AXES
                t = ["R"] * AXES
                x[axis] = "S1"
                if other == "S0":
                    x[1 - axis] = t[1 - axis] = "S0"
                xs = _dtensor_spec(mesh, refs[0], tuple(x))
                ts = _dtensor_spec(mesh, refs[1], tuple(t))
                outs = []
                for o in op.outputs:
                    places = tuple(Partial() if x[a] != "R" else Replicate()
                                   for a in range(AXES))
                    outs.append(DTensorSpec(mesh, places, tensor_meta=None))
                out.append(OpSpec(output_specs=tuple(outs), input_specs=(xs, ts)))
    return out


def replicate_strategy(n_in: int, n_out: int) -> Strategy:
    return Strategy((REPLICATE,) * n_in, (REPLICATE,) * n_out)


# ---- layer kinds --------------------------------------------------------------------------

def flat_refs(op: RecordedOp) -> list[TensorRef]:
    is_ref = lambda x: isinstance(x, TensorRef)          # noqa: E731
    return [x for x in pytree.tree_leaves((op.args, op.kwargs), is_leaf=is_ref)
            if isinstance(x, TensorRef)]


def build_kind(mesh, graph: OpGraph, rec: Recording, layer: int) -> KindGraph:
    """The :class:`KindGraph` of ``graph.layers[layer]`` (module docstring). Positions are
    positions in the layer's node list; traced ops the re-run did not see
    (``Recording.unmatched``) are replicated and joined to nothing."""
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
            strats = dtensor_strategies(mesh, op)
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
    _strided_passes(mesh, infos, by_name, graph)
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
                    rounds: int = 2) -> None:
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
                more = dtensor_strategies(mesh, op, extra) or []
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
    return [i for i, a in enumerate(kg.anchor_of) if a == anchor and i not in kg.param_chain]
