"""Step time when the ranks share CPU cores: the machine's capacity bounds the step.

A CPU "cluster" of ``N`` gloo processes on ``C < N`` cores is a processor-sharing system:
whenever more ranks are runnable than there are cores, the kernel splits the cores among
them, and a rank that waits (a pipeline bubble, a collective whose peers are late) gives its
core to the others. The step is then bounded below by the work of all ranks over the cores,
and by its dependency chain at a full core per rank::

    T = max(T_cap, T_dep)
    T_cap = (1 / p) · sum over pipeline ranks d of W_d          (times at the core share s)
    W_d   = m · sum over d's chunks of (fwd + bwd + TP comm + 2 · send
                                         [+ fwd + TP fwd, recomputed])
            + DP comm of d in full + optimizer of d
    T_dep = s · T_pipeline                                      (the Estimator's step at share
                                                                 s, run at a full core)

with ``s = min(1, C/N)``, the share every op and collective time is already scaled by
(:mod:`autoplan.cost.profiled`), so ``W_d`` is rank d's CPU seconds / s and the average over
ranks times N / C is exactly ``sum W / C``. Two things differ from the GPU composition of
:class:`~autoplan.planner.estimate.Estimator`, both because the "device" is the same cores
for everything: (1) a DP collective overlapped with backward still costs its full time (its
copies and reductions run on the cores the backward needs, so overlap hides nothing); (2) a
pipeline bubble costs nothing as long as other ranks have work for the idle core — it shows
only when ``T_dep`` binds.

Tensor-parallel collectives are counted one per sharded matmul, as the engine's DTensor TP
issues them (``parallelize_module``: an all-reduce of every row-parallel output in forward,
of every column-parallel input gradient in backward — q, k and v separately), each of its own
bytes; the GPU composition prices one all-reduce per layer and direction (Megatron-LM fuses
QKV and coalesces them). Each sharded matmul also costs the device's measured
``tp_matmul_overhead_s`` (DTensor's Python-level work per forward + backward beyond the
all-reduce, :mod:`autoplan.cost.framework_overhead`; half of it again for a recomputed
forward), at the core share, in the TP term. With DP, every wrapped module (each block and the
chunk root) costs ``dp_module_overhead_s`` per micro-batch (FSDP2's hooks), in the DP term.

The breakdown is the average rank's: compute, recompute, TP / DP / pipeline communication and
optimizer as above, and ``bubble`` = T minus those (zero when the capacity bound binds). Memory
is the Estimator's.

Sources and checks: per-rank CPU seconds of the engine's ranks (``time.process_time``) on
this 2-core machine, summed over the 4 ranks and divided by the wall time of a step, came to
1.2-1.3 cores for ten plans — DP, ZeRO-1/3, recomputation, TP 2/4, PP 2/4 — with other users'
processes taking the rest: the capacity bound is what binds here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from autoplan.cost.comm import Group
from autoplan.cost.compute import op_kind
from autoplan.graph import Layer, OpGraph
from autoplan.plan import ParallelConfig, Prediction, TimeBreakdown

if TYPE_CHECKING:
    from autoplan.planner.estimate import Estimator


def tp_collectives(layer: Layer, graph: OpGraph) -> tuple[int, int]:
    """(forward, backward) all-reduces of ``layer`` under TP: its row-parallel and
    column-parallel matmuls that read parameters (module docstring)."""
    rows = cols = 0
    for name in layer.nodes:
        node = graph.nodes[name]
        if node.params and op_kind(node) == "matmul":
            rows += node.tp_role == "row"
            cols += node.tp_role == "column"
    return rows, cols


class SharedCoreComposer:
    """The composition of the module docstring for one Estimator (caches per-layer counts)."""

    def __init__(self, share: float, *, optimizer_scale: float = 1.0,
                 tp_matmul_overhead_s: float = 0.0, dp_module_overhead_s: float = 0.0):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.share = share
        self.optimizer_scale = optimizer_scale
        self.tp_matmul_overhead_s = tp_matmul_overhead_s
        self.dp_module_overhead_s = dp_module_overhead_s
        self._counts: dict[int, tuple[int, int]] = {}

    def _tp_time(self, est: "Estimator", start: int, end: int, tp: int, micro_batch: int
                 ) -> tuple[float, float]:
        if tp == 1:
            return 0.0, 0.0
        scale = micro_batch / est.b0
        group = Group(size=tp, ranks_per_node=min(tp, est.cluster.devices_per_node))
        fwd = bwd = 0.0
        for i in range(start, end):
            layer = est.graph.layers[i]
            if i not in self._counts:
                self._counts[i] = tp_collectives(layer, est.graph)
            n_f, n_b = self._counts[i]
            st = layer.stats
            fwd += (n_f + n_b) * self.tp_matmul_overhead_s / 2 / self.share
            bwd += (n_f + n_b) * self.tp_matmul_overhead_s / 2 / self.share
            for n, nbytes, acc in ((n_f, st.tp_allreduce_fwd_bytes, 0),
                                   (n_b, st.tp_allreduce_bwd_bytes, 1)):
                if nbytes <= 0:
                    continue
                n = max(n, 1)
                t = n * est.comm.time("all_reduce", nbytes * scale / n, group)
                if acc == 0:
                    fwd += t
                else:
                    bwd += t
        return fwd, bwd

    def compose(self, est: "Estimator", p: ParallelConfig, pred: Prediction) -> Prediction:
        """``pred`` (the Estimator's, at share s) re-timed by the capacity bound."""
        from autoplan.planner.build import split_layers

        if self.share >= 1:
            return pred
        n_chunks = p.pp * p.virtual_stages
        ranges = split_layers(est.graph, n_chunks)
        ckpt = p.checkpoint == "full"
        pp_cross = est.pp_link(p).ranks_per_node == 1
        m = p.num_micro_batches
        terms = dict(compute=0.0, recompute=0.0, tp_comm=0.0, dp_comm=0.0, pp_comm=0.0,
                     optimizer=0.0)
        dgroup = est.dp_group(p)
        param_bytes = 2 if est.precision == "mixed" else 4
        for d in range(p.pp):
            params_local = modules = 0.0
            for c in range(d, n_chunks, p.pp):
                a, b = ranges[c]
                ch = est._chunk(a, b, p.tp, p.sequence_parallel, p.micro_batch, ckpt,
                                c == n_chunks - 1, pp_cross)
                tp_f, tp_b = self._tp_time(est, a, b, p.tp, p.micro_batch)
                terms["compute"] += m * (ch.fwd + ch.bwd)
                terms["recompute"] += m * ch.fwd if ckpt else 0.0
                terms["tp_comm"] += m * (tp_f + tp_b + (tp_f if ckpt else 0.0))
                terms["pp_comm"] += m * 2 * ch.send
                params_local += ch.params_local
                modules += 1 + sum(not est.graph.layers[i].name.startswith("<")
                                   for i in range(a, b))
            if p.dp > 1:
                terms["dp_comm"] += m * modules * self.dp_module_overhead_s / self.share
                terms["dp_comm"] += est.comm.time("all_reduce",
                                                  params_local * est.reduce_bytes, dgroup)
                if p.zero == 3:
                    terms["dp_comm"] += m * 2 * est.comm.time(
                        "all_gather", params_local * param_bytes, dgroup)
            shard = p.dp if p.zero >= 1 else 1
            terms["optimizer"] += self.optimizer_scale * est.compute.optimizer_time(
                params_local / shard)
        avg = {k: v / p.pp for k, v in terms.items()}
        capacity = sum(avg.values())
        step = max(capacity, self.share * pred.step_time_s)
        time = TimeBreakdown(**avg, bubble=step - capacity)
        ratio = pred.step_time_s / step
        return replace(pred, step_time_s=step, time=time,
                       tokens_per_s=pred.tokens_per_s * ratio,
                       samples_per_s=pred.samples_per_s * ratio,
                       model_tflops_per_device=pred.model_tflops_per_device * ratio,
                       hardware_tflops_per_device=pred.hardware_tflops_per_device * ratio,
                       mfu=pred.mfu * ratio)
