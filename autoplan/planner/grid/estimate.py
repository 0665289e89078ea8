"""Predict step time and memory of one uniform configuration (the planner's cost function).

For a traced graph, a cluster and a :class:`ParallelConfig` (dp, tp, pp, ZeRO stage,
sequence parallelism, micro-batch b and count m, schedule, v virtual stages, recomputation)
it returns a :class:`Prediction`. Per-layer costs come from :mod:`autoplan.cost`; this module
composes them.

Per micro-batch, chunk c (a contiguous layer range on one pipeline rank):

    t_f(c) = sum_l compute_f(l, tp, sp) · b/b0 + TP_comm_f(c) + send(c)
    t_b(c) = sum_l compute_b(l, tp, sp) · b/b0 + TP_comm_b(c) + send(c) [+ t_f(c) if recomputed]
    a(c)   = sum_l attention-core forward(l, tp, sp) · b/b0      (selective recomputation)
    g(c)   = sum_l TP-sharded GEMMs' forward / backward           (TP-communication overlap)

``b0`` is the traced micro-batch; FLOPs, bytes and activations scale linearly in b. TP comm
is one all-reduce of every row-parallel output in forward and of every column-parallel
input gradient in backward (Megatron-LM; with sequence parallelism an all-gather plus a
reduce-scatter of the same volume, so the same time). Pipeline sends carry each chunk's
output activation, split over the TP group (Megatron's scatter/gather optimisation).

Each chunk becomes a :class:`~autoplan.cost.step.ChunkCost` (its parameters one bucket synced
over the data-parallel group); :class:`~autoplan.cost.step.StepModel` composes the step as for
every other pricer (pipeline, DP, optimizer, memory, shared cores, calibration: its docstring).

Memory per chunk: model states of its parameters (TP sharding of column/row parameters),
activations (:func:`~autoplan.cost.memory.activation_bytes`) and, under recomputation, one
layer's full activations during its backward (under selective recomputation its attention
matrices: :func:`~autoplan.cost.memory.selective_peak_bytes`); under ZeRO-3 the largest
layer's gathered parameters. Recomputation: :mod:`autoplan.cost.recompute`; TP overlap:
:mod:`autoplan.cost.tp_overlap`. Under SP the embedding dropout's masks are sharded too.

On ranks sharing CPU cores (:mod:`autoplan.cost.shared_cores`) each chunk also carries its TP
collectives as DTensor issues them: an all-reduce per sharded matmul, plus per-matmul work.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from autoplan.cluster import Cluster
from autoplan.cost.batch_scale import batch_tensors
from autoplan.cost.comm import CommModel, Group
from autoplan.cost.compute import ComputeModel, op_base_name
from autoplan.cost.memory import (DEFAULT_HEADROOM, PRECISION_BYTES, activation_bytes, eager_loss,
                                  selective_peak_bytes, temporary_bytes, usable_bytes)
from autoplan.cost.parallel_dims import check_cp_comm, context_parallel_extra_activation, \
    context_parallel_time
from autoplan.cost.recompute import attention_core, core_fwd_flops, op_kept_bytes, op_node_sets
from autoplan.cost.tp_overlap import NO_OVERLAP, tp_gemm_nodes, tp_overlap
from autoplan.cost.profiled import CostProvenance, resolve_cost_models
from autoplan.cost.shared_cores import tp_collectives, tp_gathers
from autoplan.cost.step import OVERLAP_COST, REDUCE_BYTES, ChunkCost, ParamBucket, StepModel, \
    Workload, path_times
from autoplan.graph import OpGraph
from autoplan.plan import ParallelConfig, Prediction
from autoplan.planner.build import split_layers
from autoplan.planner.grid.shapes import (axis_group as _axis_group, divisors, fits,  # noqa
                                          is_block as _is_block)
from autoplan.precision import precision as precision_named

__all__ = ["OVERLAP_COST", "Estimator", "divisors", "fits"]


class Estimator:
    """Caches per-layer costs of one (graph, cluster, precision) for many configurations."""

    def __init__(self, graph: OpGraph, cluster: Cluster, *, precision: str = "mixed",
                 compute: ComputeModel | None = None, comm: CommModel | None = None,
                 flash_attention: bool = False, provenance: CostProvenance | None = None,
                 memory_headroom: float = DEFAULT_HEADROOM, fused: bool = True,
                 fused_loss: bool | None = None, float8_recipe: str = "torchao",
                 attention_kernel: str = "flash2", cp_comm: str = "all-gather"):
        """``compute`` / ``comm``: models to use instead of the cluster's measured profiles
        (:func:`~autoplan.cost.profiled.resolve_cost_models`); ``provenance``: where such
        models came from (:func:`~autoplan.cost.profiled.cost_models_for`), whose shared-core
        property and calibration the step then has; ``fused``, ``fused_loss``,
        ``float8_recipe``, ``attention_kernel``, ``cp_comm``: the runtime's kernels and
        exchanges (:func:`autoplan.api.prepare`)."""
        self.graph, self.cluster, self.precision = graph, cluster, precision
        self.cp_comm = check_cp_comm(cp_comm)
        compute_dtype = precision_named(precision, "precision").compute
        # Measured profiles and calibration where the cluster has them (autoplan.cost.profiled)
        self.compute, self.comm, self.cost_provenance = resolve_cost_models(
            cluster, precision, compute, comm, fused=fused, float8_recipe=float8_recipe,
            attention_kernel=attention_kernel)
        self.cost_provenance = provenance if provenance is not None else self.cost_provenance
        self.peak = cluster.device.peak_flops(compute_dtype)
        self.reduce_bytes, self.param_bytes = REDUCE_BYTES, PRECISION_BYTES[precision][0]
        self.flash_attention, self.eager_loss = flash_attention, eager_loss(fused, fused_loss)
        self.b0 = graph.batch.batch_size
        prov = self.cost_provenance
        self.step = StepModel(self.compute, self.comm, precision=precision,
                              memory_limit_bytes=usable_bytes(cluster.device.memory_bytes,
                                                              memory_headroom),
                              peak_flops=self.peak,
                              shared=prov.composer if prov is not None else None,
                              calibration=prov.calibration if prov is not None else None)
        self._tp_counts: dict[int, tuple[int, int, int]] = {}

    # ---- per layer, cached by (layer kind, tp, sp) --------------------------------------
    @functools.lru_cache(maxsize=None)
    def _layer_time(self, index: int, tp: int, sp: bool, micro_batch: int
                    ) -> tuple[float, float, float, float, float, float, float]:
        """(forward, backward, attention-core forward, TP-GEMM forward, TP-GEMM backward,
        op-level recomputation's repeated forward, attention-core backward) seconds of layer
        ``index`` on one device of a TP group of ``tp``: ``column``/``row``/``sharded`` ops do
        1/tp of their work, ``replicated`` ones only sequence-sharded; ops on tensors growing
        with the batch run at the micro-batch, the others (position ids, causal mask) at their
        traced size, as the search prices them."""
        scale = micro_batch / self.b0
        fwd = bwd = core = core_b = gemm_f = gemm_b = op_re = 0.0
        for name in self.graph.layers[index].nodes:
            node = self.graph.nodes[name]
            # sequence-sharded: the replicated ops on batch tensors (not a causal mask built
            # from constants, which every rank makes whole, as the search prices it)
            sharded = node.tp_role != "replicated" or (sp and self._batchy[name][0])
            f, b = self.compute.op_time_at(node, self.graph, tp if sharded else 1,
                                           scale if self._batchy[name][0] else 1.0)
            fwd += f
            bwd += b
            if name in self._core:
                core += f
                core_b += b
            if name in self._op_sets[1]:
                op_re += f
            if name in self._gemms:
                gemm_f += f
                gemm_b += b
        return fwd, bwd, core, gemm_f, gemm_b, op_re, core_b

    @functools.cached_property
    def _core(self) -> frozenset[str]:
        return attention_core(self.graph)

    @functools.cached_property
    def _op_sets(self) -> tuple[frozenset[str], frozenset[str]]:
        """(saved, recomputed) nodes of op-level recomputation (:mod:`autoplan.cost.recompute`)."""
        return op_node_sets(self.graph)

    @functools.lru_cache(maxsize=None)
    def _op_kept(self, i: int) -> tuple[float, ...]:      # once per layer, not per config
        return op_kept_bytes(self.graph, i, self._op_sets[0], lambda n: self._batchy[n][1])

    @functools.cached_property
    def _gemms(self) -> frozenset[str]:
        return tp_gemm_nodes(self.graph)

    @functools.cached_property
    def _batchy(self) -> dict[str, tuple[bool, bool]]:
        """node -> (does it read or write a tensor that grows with the batch?, do its
        outputs?): batch-dependent (:func:`~autoplan.cost.batch_scale.batch_tensors`) and
        not a scalar."""
        flags = batch_tensors(self.graph)
        out = {}
        for name, node in self.graph.nodes.items():
            ins, produced = flags[name]
            writes = produced and any(len(m.shape) > 0 for m in node.output_meta)
            reads = any(f and len(m.shape) > 0 for f, m in zip(ins, node.input_meta))
            out[name] = (reads or writes, writes)
        return out

    def _kind_time(self, index: int, tp: int, sp: bool, micro_batch: int) -> tuple:
        return self._layer_time(self._rep[self.graph.layers[index].kind], tp, sp, micro_batch)

    @functools.cached_property
    def _rep(self) -> dict[str, int]:
        """First layer index of each kind (identical layers cost the same)."""
        rep: dict[str, int] = {}
        for layer in self.graph.layers:
            rep.setdefault(layer.kind, layer.index)
        return rep

    # Mesh (pp, dp, cp, tp), row-major: tp innermost, then the cp ranks sharing a sequence,
    # then data parallelism (the expert-parallel group is ep consecutive dp ranks).
    def _axis_group(self, size: int, stride: int) -> Group:
        return _axis_group(size, max(1, self.cluster.devices_per_node // stride))

    def tp_group(self, p: ParallelConfig) -> Group:
        return self._axis_group(p.tp, 1)

    def cp_group(self, p: ParallelConfig) -> Group:
        return self._axis_group(p.cp, p.tp)

    def ep_group(self, p: ParallelConfig) -> Group:
        return self._axis_group(p.ep, p.cp * p.tp)

    def dp_group(self, p: ParallelConfig) -> Group:
        """The ranks a replicated weight's gradients are summed over: data and context
        replicas, dp·cp ranks (tp-strided)."""
        return self._axis_group(p.dp * p.cp, p.tp)

    def expert_dp_group(self, p: ParallelConfig) -> Group:
        """The ranks holding the same experts: dp / ep data-parallel indices (those equal
        modulo ep) times all cp, dp·cp / ep ranks. A node holds R = devices / tp (dp, cp)
        positions, row-major: R // cp whole dp indices, 1/ep of them in the group, each with
        its cp ranks (or, when R < cp, R ranks of one dp index)."""
        size = p.dp * p.cp // p.ep
        r = max(1, self.cluster.devices_per_node // p.tp)
        per_node = max(1, (r // p.cp) // p.ep) * p.cp if r >= p.cp else r
        return Group(size=size, ranks_per_node=min(size, per_node))

    def pp_link(self, p: ParallelConfig) -> Group:
        """Consecutive pipeline ranks are dp·cp·tp ranks apart: same node only if that fits."""
        return Group(size=2, ranks_per_node=2 if self._pp_same_node(p) else 1)

    def _pp_same_node(self, p: ParallelConfig) -> bool:
        return p.dp * p.cp * p.tp * 2 <= self.cluster.devices_per_node

    @functools.cached_property
    def _first_block(self) -> int:
        return next((l.index for l in self.graph.layers if _is_block(l.name)), 0)

    @functools.cached_property
    def _replicated_params(self) -> list[float]:
        """Per layer: parameters of its own read only by ``replicated`` ops (norms,
        embeddings; not a row-parallel op's bias, added before its output is reduced)."""
        tp_read = {fqn for node in self.graph.nodes.values() if node.tp_role != "replicated"
                   for fqn in node.params}
        out = [0.0] * len(self.graph.layers)
        for info in self.graph.params.values():
            if info.tp_dim is None and info.name not in tp_read:
                out[info.layer] += info.numel
        return out

    @functools.cached_property
    def _stats(self) -> list:
        """Per layer: its ``LayerStats`` without the saved tensors that do not grow with the
        micro-batch, and those bytes (position ids, a loss's scalars: kept once, whatever the
        micro-batch, unsharded)."""
        out = []
        for layer in self.graph.layers:
            fixed = fixed_tp = 0
            for name in layer.nodes:
                node = self.graph.nodes[name]
                if node.saved_bytes and not self._batchy[name][1]:
                    fixed += node.saved_bytes
                    fixed_tp += node.saved_bytes if node.tp_role in ("column", "sharded") else 0
            st = layer.stats
            if fixed:
                st = replace(st, saved_bytes=st.saved_bytes - fixed,
                             saved_bytes_tp=st.saved_bytes_tp - fixed_tp)
            out.append((st, float(fixed)))
        return out

    @functools.cached_property
    def _masks_only(self) -> frozenset[int]:
        """Layers before the first block keeping only dropout masks: sequence-sharded under SP
        (the engine slices before the embedding dropout, :mod:`engine.tensor_parallel`)."""
        n, keep = self.graph.nodes, self._batchy
        return frozenset(l.index for l in self.graph.layers[:self._first_block] if all(
            op_base_name(n[k].op) == "native_dropout" for k in l.nodes
            if n[k].saved_bytes and keep[k][1]))

    def _sequence_sharded(self, index: int, sp: bool) -> bool:
        """Does layer ``index`` run sequence-sharded? Under sequence parallelism every layer
        from the first block on; the embeddings before it stay replicated (as the engine
        runs them: the first block slices its input)."""
        return sp and index >= self._first_block

    def _slices_input(self, index: int, start: int, sp: bool) -> bool:
        """Does layer ``index`` (of a chunk starting at ``start``) slice its input along the
        sequence? The first block after the replicated embeddings in the same chunk, under
        sequence parallelism (Replicate -> Shard(1): free forward, its gradient all-gathered
        in backward)."""
        return sp and index == self._first_block and index > start

    @functools.lru_cache(maxsize=None)
    def _slice_reads(self, index: int) -> tuple[int, float]:
        """(reads, bytes) of the tensors layer ``index`` reads from layer ``index - 1``: each
        read slices and gathers the gradient on its own (one collective per consumer, as
        the search prices an edge)."""
        reads, nbytes = 0, 0.0
        for name in self.graph.layers[index].nodes:
            for src in self.graph.nodes[name].inputs:
                node = self.graph.nodes.get(src)
                if node is not None and node.layer == index - 1:
                    reads += 1
                    nbytes += sum(m.nbytes for m in node.output_meta)
        return reads, nbytes

    def _tp_comm(self, st, scale: float, sp: bool, group: Group, sliced: float = 0.0
                 ) -> tuple[float, float]:
        """(forward, backward) TP collectives of one layer: an all-reduce of the row-parallel
        outputs in forward and of the column-parallel input gradients in backward
        (Megatron-LM); sequence-sharded, an all-gather of the column inputs and a
        reduce-scatter of the row outputs in forward, their duals in backward (Korthikanti
        et al. 2022, sec. 4.2.2), and the gradient of a sliced input (``sliced`` bytes)
        gathered with them. Collectives of one kind in one direction are one collective of
        their summed bytes (the search's convention)."""
        row, col = st.tp_allreduce_fwd_bytes * scale, st.tp_allreduce_bwd_bytes * scale
        if not sp:
            return (self.comm.time("all_reduce", row, group),
                    self.comm.time("all_reduce", col, group))
        return (self.comm.time("all_gather", col, group)
                + self.comm.time("reduce_scatter", row, group),
                self.comm.time("all_gather", row + sliced, group)
                + self.comm.time("reduce_scatter", col, group))

    @functools.lru_cache(maxsize=None)
    def _layers(self, start: int, end: int, tp: int, sp: bool, micro_batch: int,
                recompute: str, ep: int = 1, cp: int = 1) -> tuple:
        """Per micro-batch sums over layers [start, end): compute, in-layer communication
        (TP; expert all-to-alls and the key/value exchange: :mod:`autoplan.cost.parallel_dims`),
        parameters (synced over dp·cp; over dp·cp x tp: sequence-sharded replicated ops';
        experts split over ep), activations, the recompute peak, the largest gathered layer,
        TP communication as issued on shared CPU cores, the selectively recomputed attention
        cores' forward and the TP-sharded GEMMs' forward and backward; per token 1/cp of the
        micro-batch's (load-balanced causal chunks: 1/cp of the attention work too). Each
        layer's terms (:meth:`_layer_terms`, once per run of identical layers: :attr:`_term_rep`)
        are added in layer order, as a loop computing them in place adds them (issue #18)."""
        fwd = bwd = tp_f = tp_b = act = peak = gathered = core = gemm_f = gemm_b = 0.0
        params = params_sp = experts = 0.0
        rep = self._term_rep
        for i in range(start, end):
            (f, b, g_f, g_b, tp_fs, tp_bs, par, par_sp, expert, gath, core_i, act_i,
             peak_i) = self._layer_terms(rep[i], tp, sp, micro_batch, recompute, ep, cp,
                                         self._slices_input(i, start, sp))
            fwd += f
            bwd += b
            gemm_f += g_f
            gemm_b += g_b
            for x in tp_fs:
                tp_f += x
            for x in tp_bs:
                tp_b += x
            params += par
            params_sp += par_sp
            experts += expert
            gathered = max(gathered, gath)
            if core_i is not None:
                core += core_i
            act += act_i
            if peak_i is not None:
                peak = max(peak, peak_i)
        group = self._axis_group(tp, 1)
        cpu_f, cpu_b = self._shared_tp(start, end, tp, sp, micro_batch / self.b0, group)
        return (fwd, bwd, tp_f, tp_b, params, params_sp, act, peak, gathered, cpu_f, cpu_b,
                experts, core, gemm_f, gemm_b)

    @functools.cached_property
    def _term_rep(self) -> list[int]:
        """Per layer: the first layer whose :meth:`_layer_terms` are its own for every
        configuration -- everything they read is equal: the kind (its compute,
        :meth:`_kind_time`), block or not, before the first block or not, the layer's
        statistics, its activations split (:attr:`_stats`) and its sequence-sharded
        replicated parameters. The first block, which may slice its input
        (:meth:`_slice_reads` of its own inputs), stands for itself."""
        first: dict[tuple, int] = {}
        out = []
        for i, layer in enumerate(self.graph.layers):
            key = (layer.kind, _is_block(layer.name), i >= self._first_block, layer.stats,
                   self._stats[i], self._replicated_params[i])
            out.append(i if i == self._first_block else first.setdefault(key, i))
        return out

    @functools.lru_cache(maxsize=None)
    def _layer_terms(self, i: int, tp: int, sp: bool, micro_batch: int, recompute: str,
                     ep: int, cp: int, sliced: bool) -> tuple:
        """Layer ``i``'s terms of :meth:`_layers`' sums (``sliced``: it slices its input,
        :meth:`_slices_input`): compute f, b, GEMM f, b (each / cp), the TP / expert /
        key-value collectives added to the forward and backward communication (in the order
        they are added), parameters (local, sequence-sharded replicated, experts), gathered
        parameter bytes, the recomputed attention core (None unless selective), activations
        and the recompute peak (None without recomputation)."""
        scale = micro_batch / self.b0
        tok = scale / cp
        group = self._axis_group(tp, 1)
        cp_group = self._axis_group(cp, tp)
        ep_group = self._axis_group(ep, cp * tp)
        layer = self.graph.layers[i]
        st = layer.stats
        sp_l = self._sequence_sharded(i, sp)
        f, b, core_f, g_f, g_b, op_f, core_b = self._kind_time(i, tp, sp_l, micro_batch)
        tp_f: list[float] = []
        tp_b: list[float] = []
        if tp > 1:
            cf, cb = self._tp_comm(st, tok, sp_l, group,
                                   self._slice_reads(i)[1] * tok if sliced else 0.0)
            tp_f.append(cf)
            tp_b.append(cb)
        if ep > 1 and st.moe_a2a_bytes:
            one = self.comm.time("all_to_all", st.moe_a2a_bytes * tok, ep_group)
            tp_f.append(2 * one)                # dispatch + combine
            tp_b.append(2 * one)
        kv_extra = 0.0
        if cp > 1 and st.kv_bytes:
            kv = st.kv_bytes * scale / tp       # the whole sequences' keys and values
            cf, cb = context_parallel_time(self.comm, cp_group, kv, attention_fwd=core_f / cp,
                                           attention_bwd=core_b / cp, method=self.cp_comm)
            tp_f.append(cf)
            tp_b.append(cb)
            kv_extra = context_parallel_extra_activation(kv, cp, self.cp_comm)
        e_tp = st.expert_params_tp
        expert = (e_tp / tp + st.expert_params - e_tp) / ep
        local = (st.params_tp - e_tp) / tp + (st.params - st.params_tp
                                              - st.expert_params + e_tp)
        synced_tp = self._replicated_params[i] if sp_l else 0.0
        block = _is_block(layer.name)
        ckpt = recompute == "full" and block
        selective = recompute == "selective" and block
        op_level = recompute == "op" and block
        grown, fixed = self._stats[i]
        sp_m = sp_l or (sp and i in self._masks_only)    # its activations sequence-sharded
        full = activation_bytes(grown, tp=tp, sequence_parallel=sp_m, checkpoint=False,
                                micro_batch_scale=tok,
                                flash_attention=self.flash_attention) + fixed + kv_extra
        core = peak = None
        if selective:            # the attention core recomputed: its matrices not kept
            core = core_f / cp
            act = activation_bytes(grown, tp=tp, sequence_parallel=sp_m,
                                   micro_batch_scale=tok, selective=True,
                                   flash_attention=self.flash_attention) + fixed + kv_extra
            peak = selective_peak_bytes(grown, tp=tp, micro_batch_scale=tok,
                                        flash_attention=self.flash_attention)
        elif op_level:  # input and saved outputs kept; the rest run again, with its TP comm
            split, rep, row, rows = self._op_kept(i)
            kept = split / tp + rep / (tp if sp_m else 1) + row + (rows / tp if sp_l else 0.0)
            act = activation_bytes(grown, tp=tp, sequence_parallel=sp_l and not sliced,
                                   checkpoint=True, micro_batch_scale=tok) + kept * tok
            core, peak = (op_f + (tp_f[0] * (0.5 if sp_l else 1.0) if tp > 1 else 0.0)) / cp, full
        elif ckpt:
            # the kept input, sharded as it arrives (replicated from the embeddings)
            act = activation_bytes(grown, tp=tp, sequence_parallel=sp_l and not sliced,
                                   checkpoint=True, micro_batch_scale=tok,
                                   flash_attention=self.flash_attention)
            peak = full
        else:
            act = full
        return (f / cp, b / cp, g_f / cp, g_b / cp, tuple(tp_f), tuple(tp_b),
                local - synced_tp, synced_tp, expert, (local + expert) * self.param_bytes,
                core, act, peak)

    def _shared_tp(self, start: int, end: int, tp: int, sp: bool, scale: float, group: Group
                   ) -> tuple[float, float]:
        """(forward, backward) TP seconds on ranks sharing CPU cores: one collective per
        sharded matmul (all-reduces; all-gathers and reduce-scatters sequence-sharded), each
        of its own bytes, plus DTensor's per-matmul work (:mod:`autoplan.cost.shared_cores`);
        (0, 0) elsewhere."""
        shared = self.step.shared
        if shared is None or tp == 1:
            return 0.0, 0.0
        fwd = bwd = 0.0
        for i in range(start, end):
            layer = self.graph.layers[i]
            if i not in self._tp_counts:
                self._tp_counts[i] = (*tp_collectives(layer, self.graph),
                                      tp_gathers(layer, self.graph))
            n_f, n_b, n_g = self._tp_counts[i]
            st = layer.stats
            fwd += shared.matmul_overhead(n_f + n_b)
            bwd += shared.matmul_overhead(n_f + n_b)
            row, col = st.tp_allreduce_fwd_bytes * scale, st.tp_allreduce_bwd_bytes * scale
            if not self._sequence_sharded(i, sp):
                if row > 0:
                    fwd += shared.split_time(self.comm, "all_reduce", row, n_f, group)
                if col > 0:
                    bwd += shared.split_time(self.comm, "all_reduce", col, n_b, group)
                continue
            if col > 0:
                fwd += shared.split_time(self.comm, "all_gather", col, n_g, group)
            if row > 0:
                fwd += shared.split_time(self.comm, "reduce_scatter", row, n_f, group)
            reads, sliced = self._slice_reads(i) if self._slices_input(i, start, sp) else (0, 0)
            if row + sliced > 0:
                bwd += shared.split_time(self.comm, "all_gather", row + sliced * scale,
                                         n_f + reads, group)
            if col > 0:
                bwd += shared.split_time(self.comm, "reduce_scatter", col, n_g, group)
        return fwd, bwd

    def chunk_cost(self, start: int, end: int, p: ParallelConfig, *, last: bool) -> ChunkCost:
        """The :class:`~autoplan.cost.step.ChunkCost` of layers [start, end) under ``p``."""
        return self._chunk_cost(start, end, p.tp, p.sequence_parallel, p.micro_batch,
                                p.checkpoint, last, p.dp, p.zero,
                                2 if self._pp_same_node(p) else 1, p.ep, p.cp,
                                tp_overlap(p))

    @functools.lru_cache(maxsize=None)
    def _chunk_cost(self, start: int, end: int, tp: int, sp: bool, micro_batch: int,
                    recompute: str, last: bool, dp: int, zero: int, pp_per_node: int,
                    ep: int = 1, cp: int = 1, overlap: tuple = NO_OVERLAP) -> ChunkCost:
        (fwd, bwd, tp_f, tp_b, params, params_sp, act, peak, gathered, cpu_f, cpu_b,
         experts, core, gemm_f, gemm_b) = self._layers(start, end, tp, sp, micro_batch,
                                                       recompute, ep, cp)
        send = self._send(end, tp, micro_batch, last, pp_per_node, cp)
        modules = 1 + sum(_is_block(self.graph.layers[i].name) for i in range(start, end))
        p = ParallelConfig(dp=dp, tp=tp, ep=ep, cp=cp)          # for the group shapes
        buckets = (ParamBucket(("dp",), params, self.dp_group(p)),)
        if params_sp:          # sequence-sharded norms: gradients summed over dp·cp x tp
            n = dp * cp * tp
            group = Group(size=n, ranks_per_node=min(n, self.cluster.devices_per_node))
            buckets += (ParamBucket(("dp", "tp"), params_sp, group),)
        if experts:            # expert weights: over the dp·cp / ep ranks holding them
            buckets += (ParamBucket(("edp",), experts, self.expert_dp_group(p)),)
        return ChunkCost(fwd, bwd, tp_f, tp_b, send, act, peak, recompute == "full", buckets,
                         gathered, zero, dp * cp * tp, cpu_f, cpu_b, modules,
                         transient=temporary_bytes(self.graph, start, end,
                                                   micro_batch / self.b0 / cp, tp, self.eager_loss),
                         selective=core, tp_overlap=overlap[0],
                         tp_overlap_backward=overlap[1], gemm_fwd=gemm_f, gemm_bwd=gemm_b)

    @functools.lru_cache(maxsize=None)
    def _send(self, end: int, tp: int, micro_batch: int, last: bool, pp_per_node: int,
              cp: int = 1) -> float:
        """Seconds to send a chunk's output (layer ``end - 1``'s, split over tp and cp) to
        the next pipeline rank; 0 for the last chunk."""
        if last:
            return 0.0
        scale = micro_batch / self.b0
        out_bytes = self.graph.layers[end - 1].stats.output_bytes * scale / tp / cp
        return self.comm.time("send_recv", out_bytes, Group(size=2, ranks_per_node=pp_per_node))

    # ---- a lower bound of one configuration's step time ------------------------------------
    @functools.cached_property
    def exact_pipeline_bound(self) -> bool:
        """Is :meth:`step_lower_bound` a bound of :meth:`predict`'s step time? Yes unless
        the step is reshaped after composing: ranks sharing CPU cores
        (:mod:`autoplan.cost.shared_cores`) or calibration factors other than 1."""
        cal = self.step.calibration
        return self.step.shared is None and (cal is None or cal.is_identity)

    def step_lower_bound(self, p: ParallelConfig) -> float:
        """The pipeline term of :meth:`predict`'s step time (:meth:`autoplan.cost.step.
        StepModel.compose`), without building the chunks' costs: with T_d the seconds of
        pipeline rank d per micro-batch (the sum of its chunks' T_c,
        :func:`autoplan.cost.step.path_times`),

            pipeline = sum_d T_d + (m - 1) max_d T_d          (v = 1)
            pipeline = m max_d T_d + (pp - 1) max_d T_d / v    (interleaved, v chunks)

        (Narayanan et al. 2021, sec. 2.2), times the step model's ``runtime_factor`` (1 + the
        GPU runtime overhead, :mod:`autoplan.cost.runtime`). The step adds the exposed
        data-parallel time and the optimizer step, both >= 0, before that factor, so it is at
        least this bound where :attr:`exact_pipeline_bound` holds; the uniform planner prices
        exactly only configurations this bound cannot rule out."""
        total, slow = self._rank_times(p.tp, p.sequence_parallel, p.micro_batch,
                                       p.checkpoint, p.pp, p.virtual_stages,
                                       2 if self._pp_same_node(p) else 1, p.ep, p.cp,
                                       tp_overlap(p))
        m, v = p.num_micro_batches, p.virtual_stages
        pipeline = total + (m - 1) * slow if v == 1 else m * slow + (p.pp - 1) * slow / v
        return pipeline * self.step.runtime_factor

    @functools.lru_cache(maxsize=None)
    def _rank_times(self, tp: int, sp: bool, micro_batch: int, recompute: str, pp: int,
                    v: int, pp_per_node: int, ep: int, cp: int,
                    overlap: tuple = NO_OVERLAP) -> tuple[float, float]:
        """(sum over pipeline ranks, max over ranks) of T_d (:meth:`step_lower_bound`),
        summed in :meth:`chunks`' order as ``compose`` sums them; T_c is
        :func:`~autoplan.cost.step.path_times` of chunks holding only the terms it
        reads (no parameter buckets, no memory)."""
        times = self._chunk_times(tp, sp, micro_batch, recompute, pp * v, pp_per_node, ep, cp,
                                  overlap)
        rank = [sum(times[d::pp]) for d in range(pp)]
        return sum(rank), max(rank)

    @functools.lru_cache(maxsize=None)
    def _chunk_times(self, tp: int, sp: bool, micro_batch: int, recompute: str, chunks: int,
                     pp_per_node: int, ep: int, cp: int, overlap: tuple) -> tuple[float, ...]:
        """T_c of each of the ``chunks`` chunks (:meth:`_rank_times`): the same for every
        (pp, v) with pp v = ``chunks`` (:func:`split_layers` depends on the product only)."""
        ranges = split_layers(self.graph, chunks)
        costs = []
        for c, (a, b) in enumerate(ranges):
            (fwd, bwd, tp_f, tp_b, *_, core, gemm_f, gemm_b) = self._layers(
                a, b, tp, sp, micro_batch, recompute, ep, cp)
            send = self._send(b, tp, micro_batch, c == len(ranges) - 1, pp_per_node, cp)
            costs.append(ChunkCost(fwd, bwd, tp_f, tp_b, send, 0.0, 0.0, recompute == "full",
                                   (), 0.0, 0, 1, selective=core, tp_overlap=overlap[0],
                                   tp_overlap_backward=overlap[1],
                                   gemm_fwd=gemm_f, gemm_bwd=gemm_b))
        return tuple(path_times(costs))

    # ---- one configuration ---------------------------------------------------------------
    def chunks(self, p: ParallelConfig) -> list[ChunkCost]:
        """The chunks of ``p``, in plan-stage order (chunk c on pipeline rank c mod pp)."""
        ranges = split_layers(self.graph, p.pp * p.virtual_stages)
        return [self.chunk_cost(a, b, p, last=c == len(ranges) - 1)
                for c, (a, b) in enumerate(ranges)]

    def workload(self, p: ParallelConfig) -> Workload:
        gb = p.global_batch()
        model_flops = (self.graph.fwd_flops + self.graph.bwd_flops) * gb / self.b0
        recompute_flops = 0.0
        if p.checkpoint == "full":
            recompute_flops = sum(layer.stats.fwd_flops for layer in self.graph.blocks()) \
                * gb / self.b0
        elif p.checkpoint in ("selective", "op"):     # the nodes each recomputes
            again = self._core if p.checkpoint == "selective" else self._op_sets[1]
            recompute_flops = core_fwd_flops(self.graph, core=again) * gb / self.b0
        return Workload(num_micro_batches=p.num_micro_batches, schedule=p.schedule,
                        virtual_stages=p.virtual_stages, samples=gb,
                        tokens=gb * (self.graph.batch.seq_len or 1), model_flops=model_flops,
                        recompute_flops=recompute_flops)

    def predict(self, p: ParallelConfig) -> Prediction:
        """The prediction for ``p`` (:meth:`autoplan.cost.step.StepModel.compose`: for ranks
        sharing CPU cores and calibrated where the cluster's cost model says so)."""
        return self.step.compose(self.chunks(p), self.workload(p))
