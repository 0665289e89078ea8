"""Candidate placements of every op, from DTensor's own sharding-strategy registry.

For each op of a representative layer (:mod:`autoplan.planner.search.record`) this module asks
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
replicated (``Strategy.covered`` is False; :mod:`autoplan.planner.search.explain` lists them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils import _pytree as pytree

from autoplan.placement import compact, parse, shard_dim
from autoplan.placement_dtensor import from_dtensor, to_dtensor
from autoplan.planner.search.record import RecordedOp, TensorRef

Place = str                    # "R" | "S<d>" | "P"
Spec = tuple[Place, ...]        # one placement per mesh axis
AXES = 2
REPLICATE: Spec = ("R",) * AXES


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Spec, ...]            # per tensor input (flattened argument order)
    outputs: tuple[Spec | None, ...]    # per output tensor (None: not a tensor / unknown)


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
    q = from_dtensor(p)
    return None if q is None else compact(q)


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
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    places = tuple(to_dtensor(parse(p)) for p in spec)
    meta = TensorMeta(torch.Size(ref.shape), ref.stride, ref.dtype)
    return DTensorSpec(mesh, places, tensor_meta=meta)


def dtensor_strategies(mesh, op: RecordedOp, extra: dict[int, list[Spec]] | None = None,
                       memo: dict | None = None) -> list[Strategy] | None:
    """All strategies DTensor registers for ``op`` (None if the op is not covered).
    ``extra``: more placements (strided shards a producer gives) per tensor input slot.
    ``memo``: answers kept for one probe ``mesh`` by :func:`strategy_key` -- what they
    depend on -- so that ops alike (a block's two layer norms, its residual adds) ask
    DTensor once (an exception the registry raised is raised again)."""
    if memo is not None:
        key = strategy_key(op, extra)
        if key not in memo:
            try:
                memo[key] = (dtensor_strategies(mesh, op, extra), None)
            except Exception as exc:       # noqa: BLE001 -- kept, and raised to the caller
                memo[key] = (None, exc)
        found, error = memo[key]
        if error is not None:
            raise error
        return None if found is None else list(found)
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


def strategy_key(op: RecordedOp, extra: dict[int, list[Spec]] | None = None) -> tuple:
    """What :func:`dtensor_strategies` reads of ``op``: its function, its arguments with
    each tensor as (shape, stride, dtype) -- not where it comes from --, its outputs alike,
    and ``extra``."""
    is_ref = lambda x: isinstance(x, TensorRef)          # noqa: E731

    def meta(x):
        return ("tensor", tuple(x.shape), tuple(x.stride), str(x.dtype)) if is_ref(x) else x

    args = pytree.tree_map(meta, (op.args, op.kwargs), is_leaf=is_ref)
    return (str(op.func), repr(args), repr([meta(o) for o in op.outputs]),
            repr(sorted((extra or {}).items())))


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
    replicated targets gives a partial sum. A vocabulary-parallel ``embedding`` (Megatron's
    VocabParallelEmbedding): the weight sharded on its rows along one axis, the indices
    replicated there, the output a partial sum (DTensor registers it with a masked
    partial on the indices, which the planned space has no name for); along the other
    axis everything replicated or the batch sharded."""
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
    elif name == "embedding" and len(refs) >= 2 and len(refs[0].shape) == 2:
        from torch.distributed.tensor import Partial, Replicate
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        weight, indices = refs[0], refs[1]
        for axis in range(AXES):
            for other in ["R"] + [f"S{d}" for d in range(len(indices.shape))]:
                w, i = ["R"] * AXES, ["R"] * AXES
                w[axis] = "S0"
                i[1 - axis] = other
                places = [Replicate()] * AXES
                places[axis] = Partial()
                if other != "R":
                    places[1 - axis] = to_dtensor(parse(other))
                outs = DTensorSpec(mesh, tuple(places), tensor_meta=None)
                out.append(OpSpec(output_specs=outs,
                                  input_specs=(_dtensor_spec(mesh, weight, tuple(w)),
                                               _dtensor_spec(mesh, indices, tuple(i)))))
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
