"""Cost tables of one layer kind on one logical mesh at one micro-batch.

The pieces are the cost model's (:mod:`autoplan.cost`): compute is
``ComputeModel.op_time(node, shard)`` per op, communication ``CommModel.time(collective,
bytes, group)`` per collective, memory the ZeRO model-state and activation formulas of
:mod:`autoplan.cost.memory` — the same functions the uniform planner's
:class:`~autoplan.planner.grid.estimate.Estimator` composes, so both planners price the same
configuration the same way (checked in tests/test_search.py).

Notation: mesh axes a in {0, 1} of sizes n_a; an op strategy s gives a placement per axis for
each input and output (:mod:`autoplan.planner.search.strategies`); B is the micro-batch (samples
per micro-batch of the whole stage), b0 the traced micro-batch.

* **Compute.** An op *splits* along axis a when its strategy shards (or partially sums) an
  output or shards an activation input along a. With split(s) = prod of n_a over such axes
  and scale = B / b0 for ops on batch-sized tensors (1 for the rest, e.g. a causal mask)::

      t_fwd, t_bwd = ComputeModel.op_time(node, shard = split(s) / scale)

* **Activations** kept for backward (per micro-batch, per device): the op's saved bytes
  times scale, divided by the product of n_a over the axes its output is sharded on.
* **Resharding** a tensor of S bytes (full size at B) from placement p to q, axis by axis
  (``conversions``): Shard->Replicate all-gather, Partial->Replicate all-reduce,
  Partial->Shard reduce-scatter, Shard(i)->Shard(j) all-to-all, Replicate->Shard free (a
  local slice); the collective on axis a moves S / prod_{b != a} (n_b if either placement
  shards along b).
* **Backward** of an edge: the consumer hands back the gradient in the *dual* of its input
  placement (Shard(d) -> Shard(d); Replicate -> Partial when the consumer splits along that
  axis, else Replicate; a Partial parameter input -> Replicate), and the producer needs it in
  the dual of its output placement (Shard(d) -> Shard(d), Replicate or Partial ->
  Replicate); the conversion between the two is costed like a forward one. Partial
  gradients of one tensor from several consumers are summed locally first: one collective.
* **Parameters.** A parameter's placement is the one its reading op's strategy gives it.
  Its *sync axes* are those it is replicated along while the op splits along them: its
  gradient is summed over them once per step (Rajbhandari et al. 2019, ZeRO: all-reduce, or
  reduce-scatter + all-gather, the same volume). ``psi`` buckets local parameter counts (after
  tensor sharding) by sync axes; ZeRO stage z then shards optimizer states (z >= 1),
  gradients (z >= 2) and parameters (z = 3) over the sync group, and z = 3 gathers the
  parameters twice per micro-batch (forward and backward).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from autoplan.cluster import Cluster
from autoplan.cost.comm import CommModel, Group
from autoplan.cost.compute import ComputeModel, op_kind
from autoplan.cost.memory import DEFAULT_HEADROOM, PRECISION_BYTES, eager_loss, usable_bytes
from autoplan.cost.recompute import attention_core, op_node_sets
from autoplan.cost.tp_overlap import tp_gemm_nodes
from autoplan.graph import OpGraph
from autoplan.placement import shard_dim
from autoplan.planner.search.kinds import KindGraph, members
from autoplan.planner.search.mesh import LogicalMesh
from autoplan.planner.search.packed import Internal, PackedAnchor
from autoplan.planner.search.conversions import (Conversion, conversions, grad_spec,  # noqa: F401
                                                 required_grad, splits)
from autoplan.planner.search.strategies import AXES, Spec

#: sync-axes buckets of parameters: index -> the axes
BUCKETS: tuple[tuple[int, ...], ...] = ((), (0,), (1,), (0, 1))


@dataclass(frozen=True)
class TensorEdge:
    """A tensor from (anchor u, op p, output o) into (anchor v, op m, input slot q)."""

    u: int                     # index into KindCosts.anchors (or of the producing kind)
    p: int
    o: int
    v: int
    m: int
    q: int
    nbytes: float              # full bytes at the micro-batch


#: Columns of ``KindCosts.extra``: attention-core forward s, its saved bytes, TP-GEMM s,
#: the forward s op-level recomputation runs again and the outputs it keeps (bytes).
CORE_FWD, CORE_ACT, GEMM_FWD, GEMM_BWD, OP_FWD, OP_ACT = range(6)
EXTRA = 6


@dataclass
class KindCosts:
    """Per-anchor arrays over the anchor's candidate strategies valid on ``mesh``."""

    kg: KindGraph
    mesh: LogicalMesh
    micro_batch: int
    anchors: list[int]                        # op positions
    cand: list[np.ndarray]                    # valid strategy indices per anchor
    fwd: list[np.ndarray]                     # compute seconds per micro-batch
    bwd: list[np.ndarray]
    comm_fwd: list[np.ndarray]                # resharding inside the group (followers)
    comm_bwd: list[np.ndarray]
    internal: list[list[list[tuple[str, str, int, float]]]]
    # per anchor, per candidate: (direction, collective, axis, bytes) of that resharding
    act: list[np.ndarray]                     # bytes kept per micro-batch (no recompute)
    psi: list[np.ndarray]                     # (K, 4) local parameter counts per bucket
    gathered: list[np.ndarray]                # parameter bytes held when ungathered (K,)
    edges: list[TensorEdge]                   # within the layer, between different anchors
    out_spec: list[dict[tuple[int, int], list[Spec | None]]] = field(default_factory=list)
    # per anchor: {(op pos, output): spec per candidate}
    in_info: dict[tuple[int, int], tuple[int, list[Spec], list[tuple[bool, ...]]]] = \
        field(default_factory=dict)
    # (op pos, slot) -> (anchor index, input spec per candidate, splits per candidate)
    sinks: frozenset[int] = frozenset()
    # ops whose inputs need no gradient (parameters, batch inputs, or such ops): a Partial
    # gradient reaching them is left partial and summed with the parameter gradients once
    # per step (an embedding of positions broadcast over a data-parallel batch)
    tp_matmuls: list[np.ndarray] = field(default_factory=list)
    # per anchor, per candidate: matmuls reading a parameter sharded along an axis of size
    # > 1 (tensor parallelism; what DTensor's per-module work is counted by on shared cores,
    # :mod:`autoplan.cost.shared_cores`)
    extra: list[np.ndarray] = field(default_factory=list)
    # per anchor, (candidates, EXTRA): its attention core's forward seconds and saved bytes
    # (selective recomputation, :mod:`autoplan.cost.recompute`), its TP-sharded GEMMs'
    # forward and backward seconds (:mod:`autoplan.cost.tp_overlap`), the forward seconds of
    # its ops op-level recomputation runs again and the bytes of the outputs it keeps

    def index(self, pos: int) -> int:
        return self.anchors.index(pos)


class CostModel:
    """The cost model for one (graph, cluster, precision): cached op and collective times."""

    def __init__(self, graph: OpGraph, cluster: Cluster, *, precision: str = "mixed",
                 compute: ComputeModel | None = None, comm: CommModel | None = None,
                 memory_headroom: float = DEFAULT_HEADROOM, fused: bool = True,
                 fused_loss: bool | None = None, float8_recipe: str = "torchao",
                 attention_kernel: str = "flash2"):
        self.graph = graph
        #: the loss's backward runs eager (api.prepare; ``fused`` reaches the compute model)
        self.eager_loss = eager_loss(fused, fused_loss)
        #: device memory a plan may fill (:func:`autoplan.cost.memory.usable_bytes`)
        self.memory_limit_bytes = usable_bytes(cluster.device.memory_bytes, memory_headroom)
        self.cluster = cluster
        self.precision = precision
        # the Estimator's models: measured op and link profiles and calibration where the
        # cluster has them (autoplan.cost.profiled), the roofline and alpha-beta otherwise
        from autoplan.cost.profiled import resolve_cost_models

        self.compute, self.comm, self.provenance = resolve_cost_models(
            cluster, precision, compute, comm, fused=fused, float8_recipe=float8_recipe,
            attention_kernel=attention_kernel)
        calibration = getattr(self.provenance, "calibration", None)
        self.calibration = calibration if calibration is not None and \
            not calibration.is_identity else None
        #: memory of a prediction is multiplied by this after calibration
        self.memory_factor = float(self.calibration.factors.get("memory", 1.0)) \
            if self.calibration else 1.0
        self.b0 = graph.batch.batch_size
        self.param_bytes = PRECISION_BYTES[precision][0]
        self.state_bytes = PRECISION_BYTES[precision]
        self._op_cache: dict[tuple[str, float], tuple[float, float]] = {}
        self._coll_cache: dict[tuple, float | tuple[float, float]] = {}
        self._struct_cache: dict[tuple, list] = {}
        self._facts_cache: dict[tuple, tuple] = {}
        self._packed_cache: dict[tuple, PackedAnchor] = {}
        self._tensor_edges: dict[tuple, list[TensorEdge]] = {}
        self._edge_cache: dict[tuple, tuple] = {}
        self._sinks: dict[str, frozenset[int]] = {}
        self._names = list(graph.nodes)

    # ---- primitives ----------------------------------------------------------------------
    def op_time(self, name: str, tp: int, batch_scale: float) -> tuple[float, float]:
        """(forward, backward) seconds of op ``name`` split ``tp`` ways beyond the batch, on
        ``batch_scale`` x the traced micro-batch per device: ``ComputeModel.op_time_at``,
        which the Estimator's layer times use (a measured profile if there is one, else the
        roofline at ``shard = tp / batch_scale``)."""
        key = (name, tp, batch_scale)
        hit = self._op_cache.get(key)
        if hit is None:
            node = self.graph.nodes[name]
            if hasattr(self.compute, "op_time_at"):
                hit = self.compute.op_time_at(node, self.graph, tp, batch_scale)
            else:
                hit = self.compute.op_time(node, shard=tp / batch_scale)
            self._op_cache[key] = hit
        return hit

    def coll(self, collective: str, nbytes: float, group: Group) -> float:
        """``CommModel.time``, remembered per (collective, bytes, group): the search asks
        for the same few collectives many times."""
        if nbytes <= 0 or group.size <= 1:
            return 0.0
        key = (collective, nbytes, group)
        hit = self._coll_cache.get(key)
        if hit is None:
            hit = self._coll_cache[key] = self.comm.time(collective, nbytes, group)
        return hit

    def line(self, collective: str, group: Group) -> tuple[float, float]:
        """(alpha, seconds per byte) of ``collective`` on ``group``: t = alpha + beta S for
        S > 0 (0, 0 for a group of one), the secant of ``CommModel.time`` through 1 and 2 GB
        (exact for the alpha-beta model, a line through a measured profile's fit)."""
        if group.size <= 1:
            return 0.0, 0.0
        key = ("line", collective, group)
        hit = self._coll_cache.get(key)
        if hit is None:
            t1, t2 = self.coll(collective, 1e9, group), self.coll(collective, 2e9, group)
            hit = self._coll_cache[key] = (t1 - (t2 - t1), (t2 - t1) / 1e9)
        return hit

    def conversion_time(self, convs: tuple[Conversion, ...], nbytes: float,
                        mesh: LogicalMesh) -> float:
        return sum(self.coll(c.collective, nbytes / c.divisor, mesh.group((c.axis,)))
                   for c in convs)

    @functools.cached_property
    def _core_and_gemms(self) -> tuple[frozenset[str], frozenset[str]]:
        """The attention core's ops (:func:`autoplan.cost.recompute.attention_core`) and the
        TP-sharded GEMMs (:func:`autoplan.cost.tp_overlap.tp_gemm_nodes`) of the graph."""
        return attention_core(self.graph), tp_gemm_nodes(self.graph)

    @functools.cached_property
    def op_sets(self) -> tuple[frozenset[str], frozenset[str]]:
        """(saved, recomputed) nodes of op-level recomputation
        (:func:`autoplan.cost.recompute.op_node_sets`)."""
        return op_node_sets(self.graph)

    # ---- one kind ------------------------------------------------------------------------
    def layer_nodes(self, kg: KindGraph, layer: int | None = None) -> list[str]:
        return self.graph.layers[kg.layer if layer is None else layer].nodes

    def kind_costs(self, kg: KindGraph, mesh: LogicalMesh, micro_batch: int, *,
                   exported: frozenset[int] = frozenset()) -> KindCosts:
        """Cost arrays of ``kg`` on ``mesh`` at ``micro_batch`` (module docstring).
        ``exported``: ops whose outputs the next layer reads; their saved bytes belong to
        that layer (which keeps its input), as in ``LayerStats.saved_bytes``."""
        scale_b = micro_batch / self.b0
        anchors = kg.anchors
        cand, fwd, bwd, act, psi, gathered, out_specs = [], [], [], [], [], [], []
        cfwd, cbwd, internal, tp_mm, extra = [], [], [], [], []
        in_info: dict[tuple[int, int], tuple[int, list, list]] = {}
        for ai, a in enumerate(anchors):
            pk = self._packed(kg, mesh.shape, exported, ai)
            keep = pk.valid(scale_b)
            if not len(keep):
                raise ValueError(f"op {kg.ops[a].name} ({kg.ops[a].op}) has no placement "
                                 f"valid on a {mesh.label()} mesh at micro-batch "
                                 f"{micro_batch}")
            pr = pk.price(self, mesh, scale_b)
            fwd.append(pr["fwd"][keep])
            bwd.append(pr["bwd"][keep])
            cfwd.append(pr["cf"][keep])
            cbwd.append(pr["cb"][keep])
            internal.append(Internal(pk, keep, scale_b))
            act.append(pr["act"][keep])
            extra.append(np.stack([pr["cof"][keep], pr["attn"][keep], pr["gf"][keep],
                                   pr["gb"][keep], pr["orf"][keep], pr["okept"][keep]],
                                  axis=1).reshape(len(keep), EXTRA))
            # what depends on the valid rows only, not on the micro-batch's prices
            kept = pk.kept(ai, keep)
            cand.append(kept.cand)
            psi.append(kept.psi)
            gathered.append(kept.gathered)
            tp_mm.append(kept.tp_matmuls)
            out_specs.append(kept.out_specs)
            in_info.update(kept.in_info)
        key = (kg.kind, kg.layer, micro_batch)      # the same on every mesh
        edges = self._tensor_edges.get(key)
        if edges is None:
            nodes = [self.graph.nodes[n] for n in self.layer_nodes(kg)]
            edges = self._tensor_edges[key] = self._layer_edges(kg, nodes, scale_b)
        sinks = self._sinks.get(kg.kind)
        if sinks is None:
            sinks = self._sinks[kg.kind] = grad_sinks(kg)
        return KindCosts(kg, mesh, micro_batch, anchors, cand, fwd, bwd, cfwd, cbwd, internal,
                         act, psi, gathered, edges, out_specs, in_info, sinks,
                         tp_mm, extra)

    def _layer_edges(self, kg: KindGraph, nodes: list, scale_b: float) -> list[TensorEdge]:
        """The tensors between different anchors of ``kg``'s layer, at micro-batch scale
        ``scale_b``."""
        index = {a: i for i, a in enumerate(kg.anchors)}
        edges = []
        for m, info in enumerate(kg.ops):
            if m in kg.param_chain or kg.anchor_of[m] not in index:
                continue
            v = index[kg.anchor_of[m]]
            for q, src in enumerate(info.inputs):
                if src.kind != "op" or src.ref in kg.param_chain:
                    continue
                u = index[kg.anchor_of[src.ref]]
                if u == v:
                    continue
                meta = nodes[m].input_meta[q]
                nbytes = meta.nbytes * (scale_b if _scaled(info.input_shapes[q], meta)
                                        else 1.0)
                edges.append(TensorEdge(u, src.ref, src.output, v, m, q, nbytes))
        return edges

    def _packed(self, kg: KindGraph, sizes: tuple[int, int], exported: frozenset[int],
                ai: int) -> PackedAnchor:
        """Anchor ``ai``'s :meth:`_structure` as arrays (:mod:`.packed`), cached alike."""
        key = (kg.kind, kg.layer, sizes, exported, ai)
        hit = self._packed_cache.get(key)
        if hit is None:
            hit = self._packed_cache[key] = PackedAnchor(
                self._structure(kg, sizes, exported)[ai], *self._core_and_gemms,
                self.op_sets[1])
        return hit

    def _structure(self, kg: KindGraph, sizes: tuple[int, int], exported: frozenset[int]
                   ) -> list[list[tuple[int, "_Candidate"]]]:
        """Per anchor, (strategy, what does not depend on the micro-batch) of each strategy
        valid on a mesh of ``sizes`` (cached per kind and mesh shape)."""
        key = (kg.kind, kg.layer, sizes, exported)
        hit = self._struct_cache.get(key)
        if hit is None:
            nodes = [self.graph.nodes[n] for n in self.layer_nodes(kg)]
            hit = []
            for a in kg.anchors:
                mem = members(kg, a)
                row = []
                for k in range(len(kg.ops[a].strategies)):
                    rec = self._candidate(kg, a, k, mem, nodes, sizes, exported)
                    if rec is not None:
                        row.append((k, rec))
                hit.append(row)
            self._struct_cache[key] = hit
        return hit

    def _op_facts(self, kg: KindGraph, pos: int, node) -> tuple[tuple[bool, ...], ...]:
        """(activation input?, input grows with the batch?, output grows with the batch?)
        per input / output of op ``pos``: what :meth:`_candidate` asks of every strategy on
        every mesh, which depends on neither (cached per kind and op)."""
        key = (kg.kind, kg.layer, pos)
        hit = self._facts_cache.get(key)
        if hit is None:
            info = kg.ops[pos]
            acts = tuple(src.kind in ("external", "leaf") or
                         (src.kind == "op" and src.ref not in kg.param_chain)
                         for src in info.inputs)
            hit = self._facts_cache[key] = (
                acts,
                tuple(_scaled(p, m) for p, m in zip(info.input_shapes, node.input_meta)),
                tuple(_scaled(p, m) for p, m in zip(info.output_shapes, node.output_meta)))
        return hit

    def _candidate(self, kg, a, k, mem, nodes, sizes, exported) -> "_Candidate | None":
        """Anchor ``a`` choosing strategy ``k``: what it costs, in terms of the micro-batch
        scale (None if invalid on the mesh whatever the micro-batch)."""
        rec = _Candidate()
        seen_params: set[str] = set()
        seen_moves: set = set()
        for pos in mem:
            info = kg.ops[pos]
            s = info.strategies[member_choice(kg, pos, k)]
            node = nodes[pos]
            acts, in_scaled, out_scaled = self._op_facts(kg, pos, node)
            # validity: shards divide the real dims; size-1 axes carry only Replicate
            # (a Partial parameter input, the bias of a row-parallel op, is stored replicated)
            for spec, shape_p, meta in list(zip(s.inputs, info.input_shapes, node.input_meta)) \
                    + list(zip(s.outputs, info.output_shapes, node.output_meta)):
                if spec is None:
                    continue
                for d, n in _shards(spec, sizes):
                    if d >= len(meta.shape):
                        return None
                    scaled = shape_p[d] != meta.shape[d]
                    if not scaled and meta.shape[d] % n:
                        return None
                    if scaled:
                        rec.checks.append((meta.shape[d], True, n))
            for a_ in range(AXES):
                if sizes[a_] > 1:
                    continue
                if any(o is not None and o[a_] != "R" for o in s.outputs) or any(
                        spec[a_] != "R" and not (spec[a_] == "P" and not act)
                        for spec, act in zip(s.inputs, acts)):
                    return None
            split = _splits(s, acts)
            n_split = math.prod(sizes[x] for x in range(AXES) if split[x])
            batchy = any(out_scaled) or any(in_scaled)
            # the axes along which it shards the batch (dim 0 of its batch-sized output)
            out0 = next((o for o, sc in zip(s.outputs, out_scaled) if o is not None and sc),
                        None)
            if out0 is None:     # a reduction over the batch (the loss): its batch input
                out0 = next((i for i, sc, act in zip(s.inputs, in_scaled, acts)
                             if act and sc), None)
            batch_split = math.prod(sizes[x] for x in range(AXES) if split[x] and out0
                                    is not None and _dim(out0[x]) == 0)
            rec.ops.append((node.name, n_split // batch_split, batch_split, batchy))
            move = kg.reshard.get(pos, {}).get(k)
            q = next((j for j, act in enumerate(acts) if act), None)
            if move is not None and (info.inputs[q].ref, info.inputs[q].output, move) \
                    not in seen_moves:   # the follower reshards its input first (once)
                seen_moves.add((info.inputs[q].ref, info.inputs[q].output, move))
                meta = node.input_meta[q]
                sc = in_scaled[q]
                for c in conversions(move[0], move[1], sizes):
                    rec.moves.append(("fwd", c.collective, c.axis, meta.nbytes, sc, c.divisor))
                # backward of a gather: the consumers' partial sums are reduce-scattered
                # (Megatron's sequence-parallel pairing), otherwise the dual as usual
                g = tuple("P" if a in gathered_axes(move) else x
                          for a, x in enumerate(grad_spec(move[1], split)))
                for c in conversions(g, required_grad(move[0]), sizes):
                    rec.moves.append(("bwd", c.collective, c.axis, meta.nbytes, sc, c.divisor))
            kept_here = node.saved_bytes and pos not in exported
            op_kept = node.name in self.op_sets[0]  # an output op-level recomputation keeps
            if kept_here or op_kept:
                o0 = s.outputs[0] if s.outputs else None
                shard = math.prod(sizes[x] for x in range(AXES)
                                  if o0 is not None and o0[x].startswith("S"))
                # its saved outputs grow with the batch if they do (not a loss's scalars)
                grows = any(out_scaled)
                if kept_here:
                    rec.saved.append((node.saved_bytes, grows, shard,
                                      node.saved_is_attention_matrix))
                if op_kept and grows:
                    rec.op_saved.append((float(sum(m.nbytes for m in node.output_meta)),
                                         shard))
            for o, spec in enumerate(s.outputs):
                rec.o_specs[(pos, o)] = spec
            for q, spec in enumerate(s.inputs):
                rec.i_specs[(pos, q)] = (spec, split)
            # parameters read by this op (directly or through a view of it)
            tp_matmul = False
            for q, src in enumerate(info.inputs):
                fqn, pspec = param_spec(kg, src, s.inputs[q])
                if fqn is not None and pspec is not None and node.params and \
                        op_kind(node) == "matmul" and any(
                            pspec[x].startswith("S") and sizes[x] > 1 for x in range(AXES)):
                    tp_matmul = True
                if fqn is None or fqn in seen_params:
                    continue
                if pspec is None:
                    return None
                pinfo = self.graph.params.get(fqn)
                if pinfo is None or pinfo.layer != kg.layer:
                    continue
                seen_params.add(fqn)
                shard = math.prod(sizes[x] for x in range(AXES) if pspec[x].startswith("S"))
                local = pinfo.numel / shard
                raw = s.inputs[q]       # a Partial use (a row-parallel bias) gets an R grad
                sync = tuple(x for x in range(AXES) if sizes[x] > 1 and raw[x] == "R"
                             and not pspec[x].startswith("S") and split[x])
                rec.pvec[BUCKETS.index(sync)] += local
                rec.gbytes += local * self.param_bytes
            rec.tp_matmuls += tp_matmul
        return rec


#: the work-splitting axes of a strategy, cached (asked per strategy, mesh and member op)
_splits = functools.lru_cache(maxsize=65536)(splits)

#: shard_dim of a placement string, cached (a pure function the structure asks ~80,000
#: times of a handful of strings)
_dim = functools.lru_cache(maxsize=None)(shard_dim)


@functools.lru_cache(maxsize=None)
def _shards(spec: Spec, sizes: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """(tensor dim, devices it is split over) of each dim ``spec`` shards on a mesh of
    ``sizes``: the dims in the order of the set of them, each with the product of the
    sizes of the axes sharding it."""
    return tuple((d, math.prod(sizes[x] for x in range(AXES) if _dim(spec[x]) == d))
                 for d in {_dim(p) for p in spec if p.startswith("S")})


@dataclass
class _Candidate:
    """What one anchor strategy costs, independent of the micro-batch (``scaled``/``batchy``
    say which figures grow with it)."""

    checks: list[tuple[int, bool, int]] = field(default_factory=list)  # (dim, scaled, divisor)
    ops: list[tuple[str, int, int, bool]] = field(default_factory=list)
    # (node, split beyond the batch, batch split, batchy)
    moves: list[tuple] = field(default_factory=list)    # (dir, coll, axis, bytes, scaled, div)
    saved: list[tuple[int, bool, int, bool]] = field(default_factory=list)
    # (bytes, batchy, shard, an attention matrix?)
    op_saved: list[tuple[float, int]] = field(default_factory=list)
    # outputs op-level recomputation keeps, those growing with the batch (as
    # :func:`autoplan.cost.recompute.op_kept_bytes` counts them): (bytes, shard)
    pvec: list[float] = field(default_factory=lambda: [0.0] * len(BUCKETS))
    gbytes: float = 0.0
    tp_matmuls: int = 0
    o_specs: dict = field(default_factory=dict)
    i_specs: dict = field(default_factory=dict)


def _scaled(shape_probe, meta) -> bool:
    """Does a tensor grow with the batch (its probe shape differs from the traced one)?"""
    return tuple(shape_probe) != tuple(meta.shape)


def gathered_axes(move: tuple[Spec, Spec] | None) -> set[int]:
    """Axes a follower's input resharding gathers (Shard -> Replicate)."""
    if move is None:
        return set()
    return {a for a in range(AXES) if move[0][a].startswith("S") and move[1][a] == "R"}


def passes_partial(kg: KindGraph, pos: int, anchor_choice: int, axis: int) -> bool:
    """Does op ``pos`` (a follower that gathered its input along ``axis``) take a Partial
    gradient back unchanged, to reduce-scatter it itself?"""
    move = kg.reshard.get(pos, {}).get(anchor_choice)
    return axis in gathered_axes(move)


def grad_sinks(kg: KindGraph) -> frozenset[int]:
    """Positions of ops none of whose inputs needs a gradient (see KindCosts.sinks)."""
    out: set[int] = set()
    for info in kg.ops:
        if all(src.kind in ("param", "leaf") or (src.kind == "op" and (
                src.ref in out or src.ref in kg.param_chain)) for src in info.inputs):
            out.add(info.pos)
    return frozenset(out)


def member_choice(kg: KindGraph, pos: int, k: int) -> int:
    return k if kg.anchor_of[pos] == pos else kg.follow[pos][k]


def param_spec(kg: KindGraph, src, use: Spec) -> tuple[str | None, Spec | None]:
    """(FQN, placement in the parameter's own dims) of a parameter input, or (None, None)."""
    if src.kind == "param":
        return src.ref, tuple("R" if p == "P" else p for p in use)
    if src.kind == "op" and src.ref in kg.param_chain:
        fqn = kg.param_chain[src.ref]
        for pspec, vspec in kg.param_chain_map[src.ref].items():
            if vspec == use:
                return fqn, pspec
        return fqn, None
    return None, None


def edge_matrices(cm: CostModel, kc_u: KindCosts, kc_v: KindCosts, edges: list[TensorEdge],
                  multi: set[tuple[int, int]] | None = None
                  ) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """(u, v) -> (forward, backward) resharding seconds per micro-batch, K_u x K_v.

    Backward Partial->X conversions into the producer anchors in ``multi`` (read by several
    anchors) are left out: the ILP charges them once per producer group
    (:mod:`autoplan.planner.search.intra_op`)."""
    multi = multi or set()      # producer anchors whose Partial gradients are summed once
    key = (id(kc_u), id(kc_v), tuple(edges), frozenset(multi))
    hit = cm._edge_cache.get(key)
    if hit is not None and hit[0] is kc_u and hit[1] is kc_v:
        return hit[2]
    out = _edge_matrices(cm, kc_u, kc_v, edges, multi)
    cm._edge_cache[key] = (kc_u, kc_v, out)
    return out


def _edge_matrices(cm: CostModel, kc_u: KindCosts, kc_v: KindCosts, edges: list[TensorEdge],
                   multi: set) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    mesh = kc_v.mesh
    out: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    # the same placements, bytes and Partial rule, the same cost (across the edges too:
    # a layer's activations are mostly of one size)
    memo: dict[tuple, tuple[float, float]] = {}
    for e in edges:
        src = kc_u.out_spec[e.u][(e.p, e.o)]
        _, dst, spl = kc_v.in_info[(e.m, e.q)]
        key = (e.u, e.v)
        if key not in out:
            shape = (len(kc_u.cand[e.u]), len(kc_v.cand[e.v]))
            out[key] = (np.zeros(shape), np.zeros(shape))
        fm, bm = out[key]
        keep_partial = not (e.u in multi or e.p in kc_u.sinks)
        for i, s_spec in enumerate(src):
            k_i = kc_u.cand[e.u][i]
            passing = tuple(a for a in range(AXES) if passes_partial(kc_u.kg, e.p, k_i, a))
            for j, d_spec in enumerate(dst):
                if s_spec is None or d_spec is None:
                    fm[i, j] = bm[i, j] = math.inf
                    continue
                key = (s_spec, d_spec, spl[j], passing, e.nbytes, keep_partial)
                hit = memo.get(key)
                if hit is None:
                    tf = cm.conversion_time(conversions(s_spec, d_spec, mesh.shape), e.nbytes,
                                            mesh)
                    g = grad_spec(d_spec, spl[j])
                    convs = tuple(c for c in conversions(g, required_grad(s_spec), mesh.shape)
                                  if not (g[c.axis] == "P" and (
                                      not keep_partial or c.axis in passing)))
                    hit = memo[key] = (tf, cm.conversion_time(convs, e.nbytes, mesh))
                fm[i, j] += hit[0]
                bm[i, j] += hit[1]
    return out
