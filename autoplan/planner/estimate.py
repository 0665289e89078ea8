"""Predict step time and memory of one uniform configuration (the planner's cost function).

For a traced graph, a cluster and a :class:`ParallelConfig` (dp, tp, pp, ZeRO stage,
sequence parallelism, micro-batch b and count m, schedule, v virtual stages, recomputation)
it returns a :class:`Prediction`. Per-layer costs come from :mod:`autoplan.cost`; this module
composes them.

Per micro-batch, chunk c (a contiguous layer range on one pipeline rank):

    t_f(c) = sum_l compute_f(l, tp, sp) · b/b0 + TP_comm_f(c) + send(c)
    t_b(c) = sum_l compute_b(l, tp, sp) · b/b0 + TP_comm_b(c) + send(c) [+ t_f(c) if recomputed]

``b0`` is the traced micro-batch; FLOPs, bytes and activations scale linearly in b. TP comm
is one all-reduce of every row-parallel output in forward and of every column-parallel
input gradient in backward (Megatron-LM; with sequence parallelism an all-gather plus a
reduce-scatter of the same volume, so the same time). Pipeline sends carry each chunk's
output activation, split over the TP group (Megatron's scatter/gather optimisation).

Pipeline latency (Alpa, Zheng et al. 2022, eq. 2; GPipe and 1F1B take the same time):

    T = sum_s (t_f + t_b)(s) + (m - 1) · max_s (t_f + t_b)(s)            v = 1
    T = m · max_d T_d + (pp - 1) · max_d T_d / v                          interleaved

with T_d the per-micro-batch time of pipeline rank d over its v chunks (Narayanan et al.
2021: bubble fraction (pp-1)/(v·m)).

Data parallelism: gradients (in the reduce dtype) are all-reduced once per step (ZeRO-1/2: a
reduce-scatter plus an all-gather, same volume, Rajbhandari et al. 2019), overlapped with the
last micro-batch's backward; ZeRO-3 also all-gathers parameters before each micro-batch's
forward and backward (3Ψ traffic), overlapped with that micro-batch's compute. The part that
compute cannot hide is added, plus OVERLAP_COST of the hidden part. The optimizer step reads and writes the Adam state
per local parameter (Adam: param, grad, two moments; ComputeModel.optimizer_time).

Memory per device (pipeline rank d): model states of its parameters (ZeRO over dp, TP
sharding of column/row parameters), plus activations of its layers times the micro-batches
in flight for the schedule, plus, under recomputation, one layer's full activations during
its backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autoplan.cluster import Cluster
from autoplan.cost.comm import CommModel, Group
from autoplan.cost.compute import ComputeModel
from autoplan.cost.memory import activation_bytes, in_flight_micro_batches, model_state_bytes
from autoplan.cost.profiled import resolve_cost_models
from autoplan.graph import OpGraph
from autoplan.plan import MemoryBreakdown, ParallelConfig, Prediction, TimeBreakdown
from autoplan.planner.build import split_layers

# Fraction of an overlapped collective's time that still slows the step. An assumption (no
# published figure in ../shared/reference/published.md), to be replaced by calibration from
# measured runs (issue #4); it also makes the planner prefer less traffic when times tie.
OVERLAP_COST = 0.1


@dataclass(frozen=True)
class _Chunk:
    fwd: float                 # seconds per micro-batch, compute only
    bwd: float
    tp_fwd: float              # TP communication per micro-batch
    tp_bwd: float
    send: float                # pipeline send of the output (and its gradient back)
    params_local: float        # parameters held per device after TP sharding
    act_bytes: float           # activation bytes per micro-batch kept for backward
    recompute_peak: float      # one layer's full activations (if recomputed)
    flops_fwd: float           # model FLOPs per micro-batch on one device (after TP)
    flops_bwd: float


class Estimator:
    """Caches per-layer costs of one (graph, cluster, precision) for many configurations."""

    def __init__(self, graph: OpGraph, cluster: Cluster, *, precision: str = "mixed",
                 compute: ComputeModel | None = None, comm: CommModel | None = None,
                 flash_attention: bool = False):
        self.graph = graph
        self.cluster = cluster
        self.precision = precision
        compute_dtype = "bfloat16" if precision == "mixed" else "float32"
        # Measured profiles and calibration where the cluster has them (autoplan.cost.profiled)
        self.compute, self.comm, self.cost_provenance = resolve_cost_models(cluster, precision,
                                                                            compute, comm)
        self.peak = cluster.device.peak_flops(compute_dtype)
        self.reduce_bytes = 4                      # gradients reduced in fp32
        self.flash_attention = flash_attention
        self.b0 = graph.batch.batch_size

    # ---- per layer, cached by (layer kind, tp, sp) --------------------------------------
    @functools.lru_cache(maxsize=None)
    def _layer_time(self, index: int, tp: int, sp: bool, micro_batch: int) -> tuple[float, float]:
        return self.compute.layer_time(self.graph.layers[index], self.graph, tp=tp,
                                       sequence_parallel=sp,
                                       micro_batch_scale=micro_batch / self.b0)

    def _kind_time(self, index: int, tp: int, sp: bool, micro_batch: int) -> tuple[float, float]:
        return self._layer_time(self._rep[self.graph.layers[index].kind], tp, sp, micro_batch)

    @functools.cached_property
    def _rep(self) -> dict[str, int]:
        """First layer index of each kind (identical layers cost the same)."""
        rep: dict[str, int] = {}
        for layer in self.graph.layers:
            rep.setdefault(layer.kind, layer.index)
        return rep

    def tp_group(self, p: ParallelConfig) -> Group:
        return Group(size=p.tp, ranks_per_node=min(p.tp, self.cluster.devices_per_node))

    def dp_group(self, p: ParallelConfig) -> Group:
        per_node = max(1, self.cluster.devices_per_node // p.tp)
        return Group(size=p.dp, ranks_per_node=min(p.dp, per_node))

    def pp_link(self, p: ParallelConfig) -> Group:
        """Consecutive pipeline ranks are dp·tp ranks apart: same node only if that fits."""
        same_node = p.dp * p.tp * 2 <= self.cluster.devices_per_node
        return Group(size=2, ranks_per_node=2 if same_node else 1)

    @functools.lru_cache(maxsize=None)
    def _chunk(self, start: int, end: int, tp: int, sp: bool, micro_batch: int,
               checkpoint: bool, last: bool, pp_cross: bool) -> _Chunk:
        scale = micro_batch / self.b0
        fwd = bwd = tp_f = tp_b = act = peak = ffw = fbw = 0.0
        params = 0.0
        group = Group(size=tp, ranks_per_node=min(tp, self.cluster.devices_per_node))
        for i in range(start, end):
            layer = self.graph.layers[i]
            st = layer.stats
            f, b = self._kind_time(i, tp, sp, micro_batch)
            fwd += f
            bwd += b
            if tp > 1:
                tp_f += self.comm.time("all_reduce", st.tp_allreduce_fwd_bytes * scale, group)
                tp_b += self.comm.time("all_reduce", st.tp_allreduce_bwd_bytes * scale, group)
            params += st.params_tp / tp + (st.params - st.params_tp)
            is_block = not layer.name.startswith("<")
            ckpt = checkpoint and is_block
            act += activation_bytes(st, tp=tp, sequence_parallel=sp, checkpoint=ckpt,
                                    micro_batch_scale=scale,
                                    flash_attention=self.flash_attention)
            if ckpt:
                full = activation_bytes(st, tp=tp, sequence_parallel=sp, checkpoint=False,
                                        micro_batch_scale=scale,
                                        flash_attention=self.flash_attention)
                peak = max(peak, full)
            ffw += (st.fwd_flops_tp / tp + st.fwd_flops - st.fwd_flops_tp) * scale
            fbw += (st.bwd_flops_tp / tp + st.bwd_flops - st.bwd_flops_tp) * scale
        send = 0.0
        if not last:
            out_bytes = self.graph.layers[end - 1].stats.output_bytes * scale / tp
            send = self.comm.time("send_recv", out_bytes,
                                  Group(size=2, ranks_per_node=1 if pp_cross else 2))
        return _Chunk(fwd, bwd, tp_f, tp_b, send, params, act, peak, ffw, fbw)

    # ---- one configuration ---------------------------------------------------------------
    def predict(self, p: ParallelConfig) -> Prediction:
        """The prediction for ``p``; where the cluster has them, composed for ranks sharing CPU
        cores and calibrated (:meth:`autoplan.cost.profiled.CostProvenance.finish`)."""
        pred = self._predict(p)
        if self.cost_provenance is not None:
            pred = self.cost_provenance.finish(self, p, pred)
        return pred

    def _predict(self, p: ParallelConfig) -> Prediction:
        n_chunks = p.pp * p.virtual_stages
        ranges = split_layers(self.graph, n_chunks)
        ckpt = p.checkpoint == "full"
        pp_cross = self.pp_link(p).ranks_per_node == 1
        chunks = [self._chunk(a, b, p.tp, p.sequence_parallel, p.micro_batch, ckpt,
                              c == n_chunks - 1, pp_cross)
                  for c, (a, b) in enumerate(ranges)]
        m = p.num_micro_batches

        def t_chunk(c: _Chunk) -> float:
            t = c.fwd + c.bwd + c.tp_fwd + c.tp_bwd + 2 * c.send
            if ckpt:
                t += c.fwd + c.tp_fwd
            return t

        # per pipeline rank: its v chunks
        dev_chunks = [[chunks[c] for c in range(d, n_chunks, p.pp)] for d in range(p.pp)]
        dev_time = [sum(t_chunk(c) for c in cs) for cs in dev_chunks]
        slow = max(range(p.pp), key=lambda d: dev_time[d])
        if p.virtual_stages == 1:
            pipeline = sum(dev_time) + (m - 1) * dev_time[slow]
        else:
            pipeline = m * dev_time[slow] + (p.pp - 1) * dev_time[slow] / p.virtual_stages

        sc = dev_chunks[slow]
        compute = m * sum(c.fwd + c.bwd for c in sc)
        recompute = m * sum(c.fwd for c in sc) if ckpt else 0.0
        tp_comm = m * sum(c.tp_fwd + c.tp_bwd + (c.tp_fwd if ckpt else 0.0) for c in sc)
        pp_comm = m * sum(2 * c.send for c in sc)
        bubble = max(0.0, pipeline - compute - recompute - tp_comm - pp_comm)

        # data parallelism and the optimizer, per pipeline rank; the slowest rank binds
        dp_exposed, opt_time = [], []
        dgroup = self.dp_group(p)
        for cs in dev_chunks:
            params_local = sum(c.params_local for c in cs)
            last_bwd = sum(c.bwd for c in cs)
            mb_compute = sum(c.fwd + c.bwd for c in cs)
            exposed = 0.0
            if p.dp > 1:
                grads = params_local * self.reduce_bytes
                t_reduce = self.comm.time("all_reduce", grads, dgroup)
                exposed = _exposed(t_reduce, last_bwd)
                if p.zero == 3:
                    t_gather = self.comm.time("all_gather", params_local * 2
                                              if self.precision == "mixed" else params_local * 4,
                                              dgroup)
                    exposed += m * _exposed(2 * t_gather, mb_compute)
            dp_exposed.append(exposed)
            shard = p.dp if p.zero >= 1 else 1
            opt_time.append(self.compute.optimizer_time(params_local / shard))
        dp_comm = max(dp_exposed)
        optimizer = max(opt_time)
        step = pipeline + dp_comm + optimizer

        # memory per pipeline rank
        per_stage = []
        for d, cs in enumerate(dev_chunks):
            params_local = sum(c.params_local for c in cs)
            states = model_state_bytes(params_local, dp=p.dp, zero=p.zero,
                                       precision=self.precision)
            in_flight = in_flight_micro_batches(p.schedule, p.pp, d, m, p.virtual_stages)
            acts = in_flight * sum(c.act_bytes for c in cs)
            acts += max((c.recompute_peak for c in cs), default=0.0)
            per_stage.append(MemoryBreakdown(params=states.params, grads=states.grads,
                                             optimizer=states.optimizer, activations=acts,
                                             other=self._other_bytes(p, cs)))
        worst = max(per_stage, key=lambda mb: mb.total)

        tokens = p.global_batch() * (self.graph.batch.seq_len or 1)
        model_flops = (self.graph.fwd_flops + self.graph.bwd_flops) * p.global_batch() / self.b0
        recompute_flops = 0.0
        if ckpt:
            recompute_flops = sum(layer.stats.fwd_flops for layer in self.graph.blocks()) \
                * p.global_batch() / self.b0
        world = p.world_size
        return Prediction(
            step_time_s=step,
            tokens_per_s=tokens / step,
            samples_per_s=p.global_batch() / step,
            model_tflops_per_device=model_flops / step / world / 1e12,
            hardware_tflops_per_device=(model_flops + recompute_flops) / step / world / 1e12,
            mfu=model_flops / step / world / self.peak,
            memory=worst,
            memory_limit_bytes=self.cluster.device.memory_bytes,
            time=TimeBreakdown(compute=compute, recompute=recompute, tp_comm=tp_comm,
                               dp_comm=dp_comm, pp_comm=pp_comm, bubble=bubble,
                               optimizer=optimizer),
            memory_per_stage=tuple(per_stage),
        )

    def _other_bytes(self, p: ParallelConfig, chunks: list[_Chunk]) -> float:
        """Buffers beyond states and activations: under ZeRO-3 the largest layer's gathered
        parameters (prefetch keeps two layers unsharded)."""
        if p.zero != 3 or p.dp == 1:
            return 0.0
        largest = max(layer.stats.params_tp / p.tp + layer.stats.params - layer.stats.params_tp
                      for layer in self.graph.layers)
        return 2 * largest * (2 if self.precision == "mixed" else 4)


def _exposed(comm: float, compute: float) -> float:
    """Time a collective adds when overlapped with ``compute`` seconds of work: what the
    compute cannot hide, plus OVERLAP_COST of the hidden part (the collective's kernels take
    SMs and memory bandwidth from the compute they overlap)."""
    hidden = min(comm, compute)
    return comm - hidden + OVERLAP_COST * hidden


def fits(pred: Prediction) -> bool:
    return pred.memory.total <= pred.memory_limit_bytes


def divisors(n: int) -> list[int]:
    out = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(out + [n // d for d in out]))
