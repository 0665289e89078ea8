"""One training step from per-chunk terms: the single place the cost model is composed.

Every pricer — the grid (:class:`~autoplan.planner.grid.estimate.Estimator`), the search
(:class:`~autoplan.planner.search.evaluate.Evaluator`), ``autoplan estimate``, the report and
calibration — prices the *chunks* of a configuration (a chunk: a contiguous layer range on
one pipeline rank's devices) into :class:`ChunkCost` records and hands them to
:meth:`StepModel.compose`, which turns them into a step time and per-device memory
(a :class:`~autoplan.plan.Prediction`). How a chunk is priced differs (per layer kind under a
uniform TP degree, or per op under searched placements); how chunks make a step does not.

Notation: chunk c on pipeline rank d = c mod pp (pp ranks, v chunks each, m micro-batches),
per micro-batch: compute t_f(c), t_b(c); in-layer communication (tensor parallelism,
resharding) tp_f(c), tp_b(c); s(c) the pipeline send of its output (s(-1) = 0: the first chunk
receives nothing); r(c) = 1 if its blocks are recomputed (full activation
checkpointing: the forward and its communication again in backward); a(c) the forward
seconds of its blocks' attention cores, recomputed in backward under selective
recomputation (:mod:`autoplan.cost.recompute`; 0 otherwise). Under TP-communication
overlap (``ChunkCost.tp_overlap`` = n > 0 steps) tp_f and tp_b stand for what the step still
pays of them beside the TP-sharded GEMMs' g_f(c), g_b(c) seconds:
paid(tp_f, g_f, n), paid(tp_b, g_b, n); under the backward-only overlap
(``ChunkCost.tp_overlap_backward`` = c > 0, Megatron-LM's asynchronous input-gradient
collectives) tp_b stands for paid_bwd(tp_b, g_b, c) (:mod:`autoplan.cost.tp_overlap`).

**Pipeline** (Alpa, Zheng et al. 2022, eq. 2; GPipe and 1F1B take the same time)::

    T_c = t_f + t_b + tp_f + tp_b + s(c) + s(c - 1) + r (t_f + tp_f) + a   per micro-batch
    T_d = sum over the chunks c of rank d of T_c
    T   = sum_d T_d + (m - 1) max_d T_d                          v = 1
    T   = m max_d T_d + (pp - 1) max_d T_d / v                   interleaved 1F1B

(Narayanan et al. 2021: the interleaved bubble is (pp - 1)/(v m) of the ideal time).
Both boundaries of a chunk are on its path, each once per micro-batch: the schedules batch
a forward's send with a backward's receipt over the same boundary in opposite directions
(torch.distributed.pipelining's ``Schedule1F1B``; Megatron-LM's
``send_forward_recv_backward``), which full-duplex links carry at once, so its output
boundary costs s(c) and its input boundary s(c - 1) (:mod:`autoplan.cost.pipeline_comm`).
The last chunk, which holds the LM head and is often the slowest, pays its input's
boundary; the first pays one boundary, not two.
The breakdown is the slowest rank's: compute m sum (t_f + t_b), recompute m sum (r t_f + a),
tp_comm m sum (tp_f + tp_b + r tp_f), pp_comm m sum (s(c) + s(c - 1)), bubble = T minus
those.

**Data parallelism.** A chunk's parameters come in buckets (:class:`ParamBucket`): psi_b
local parameters whose gradients are summed over group g_b (the data-parallel group of a
uniform plan; in a searched plan the mesh axes a parameter is replicated along while its op
splits). Per rank d, with the Adam-state bytes (p, g, o) of the precision and R = 4 bytes
per reduced gradient (fp32)::

    A_d = sum_b all_reduce(R psi_b, g_b)                        once per step (ZeRO-0)
    A_d = sum_b reduce_scatter(R psi_b, g_b)                    once per step (ZeRO-1/2)
    G_d = sum_b all_gather(p psi_b, g_b)                        once per step (ZeRO-1/2)
    E_d = A_last + x(A_d - A_last, sum_c t_b)                   buckets over the backward
        + G_first + x(G_d - G_first, sum_c t_f)                 units over the forward (1/2)
    E_d = m z3(U, g, r, f, b)                                   ZeRO-3, per micro-batch
    x(C, W) = max(0, C - W) + INTERFERENCE min(C, W)

(:mod:`autoplan.cost.overlap`): a reduction hides only behind the backward of the last
micro-batch, and its last bucket (A_last: 25 MiB of gradients, PyTorch DDP's default) behind
nothing. **ZeRO-1/2** shard the optimizer, so the gradients are reduce-scattered, not
all-reduced (each rank steps its own shard), and the updated parameters are all-gathered
back (Rajbhandari et al. 2020, sec. 5.1: 2 psi of traffic like DDP's all-reduce, but half
of it in the parameters' dtype and after the step): autoplan's engine runs that all-gather
as FSDP2's per-unit pre-forward gather of the next step, prefetched one unit ahead, and
Megatron-LM's distributed optimizer with ``--overlap-param-gather`` overlaps it with the
next forward the same way, so it hides behind the first micro-batch's forward except for the
first unit's (G_first = all_gather(p psi_b / U)). **ZeRO-2 over m > 1 micro-batches** keeps
its gradients sharded only by reducing them every micro-batch: without pipeline parallelism
FSDP reduce-scatters after each backward and accumulates the shards
(R_d = sum_b reduce_scatter(R psi_b, g_b); E_d = m (R_last + x(R_d - R_last, sum_c t_b)));
under pipeline parallelism the schedule
accumulates unsharded gradients over the micro-batches and reduces once (torch.distributed
.pipelining; DeepSpeed refuses ZeRO-2 with its pipeline engine), so its memory is ZeRO-1's
(:mod:`engine.data_parallel`, which runs both). Under ZeRO-3 the rank's U units (FSDP's
wrapped modules, ``ChunkCost.modules``) each all-gather their parameters before forward
and again before backward (g = all_gather(p psi_b / U)) and reduce-scatter their gradients
after backward (r = reduce_scatter(R psi_b / U)), prefetching one unit ahead, so a unit
whose collectives outlast its compute (f = sum_c (t_f + tp_f) / U; b the same for
backward, with the recomputed forward) exposes the difference (Rajbhandari et al. 2019
sec. 7.2.2 for the volumes; Zhao et al. 2023 for FSDP's order). INTERFERENCE = 0.1 is the
share of SMs NCCL's channels take from the compute they overlap. The collective times are
NCCL's (:mod:`autoplan.cost.comm`): a ring's latency grows with its ranks.

**Optimizer**: ``ComputeModel.optimizer_time`` of the local parameters, sum_b psi_b
(/ |g_b| under ZeRO >= 1). **Step**: (T + max_d E_d + max_d optimizer_d)(1 + r), r the GPU
runtime overhead no term prices, fitted on published runs (:mod:`autoplan.cost.runtime`:
0.073 on an uncalibrated GPU cluster, else 0), shown as the breakdown's ``runtime``.

**Memory** of rank d (:mod:`autoplan.cost.memory`): model states per bucket
(``model_state_bytes(psi_b, dp=|g_b|, zero)``), activations ``max_t sum_c live_c(t) act(c)
+ max_c recompute_peak(c)`` with ``live_c(t)`` the forwards of chunk c whose backward has not
run at step t of the schedule's order (:func:`autoplan.cost.memory.in_flight_weighted`; for
equal chunks ``in_flight(schedule, pp, d, m, v) * sum_c act(c)``), and under ZeRO-3 (a bucket synced over more
than one rank) two layers' gathered parameters, ``2 max_c gathered(c)`` (prefetch keeps the
next layer gathered). The prediction's memory is the rank that needs the most.

**Ranks sharing CPU cores** (:mod:`autoplan.cost.shared_cores`, when the cost model's
:class:`~autoplan.cost.shared_cores.SharedCores` has share s < 1): the step is also bounded
by the work of all ranks over the cores::

    W_d  = m sum_c (t_f + t_b + r t_f + a + cpu_tp_f + cpu_tp_b + r cpu_tp_f + 2 s_c)
           + [DP] (m modules_d dp_module_overhead / s + A_d + 2 m G_d)   (_syncs, shared)
           + optimizer_scale optimizer_d
    T'   = max(mean over devices of W_d, s * (T + max E + max optimizer))

with cpu_tp the chunk's in-layer collectives as the engine issues them on CPU
(:class:`ChunkCost`); the breakdown is the mean rank's, bubble the rest.

**Calibration** (:mod:`autoplan.cost.calibration`), when the cluster has factors, scales the
terms last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autoplan.cost.comm import CommModel, Group
from autoplan.cost.compute import ComputeModel
from autoplan.cost.memory import (PRECISION_BYTES, fragmentation_bytes, in_flight_weighted,
                                  model_state_bytes, runtime_bytes)
from autoplan.cost.overlap import (DDP_BUCKET_BYTES, INTERFERENCE, bucketed_reduction,
                                   zero3_micro_batch)
from autoplan.cost.runtime import runtime_factor
from autoplan.cost.shared_cores import SharedCores
from autoplan.cost.tp_overlap import paid, paid_backward
from autoplan.plan import MemoryBreakdown, Prediction, StageTime, TimeBreakdown

#: Fraction of an overlapped collective's time that still slows the step (NCCL's SMs,
#: :data:`autoplan.cost.overlap.INTERFERENCE`); the search's ILP hinges use it too.
OVERLAP_COST = INTERFERENCE
#: Bytes per gradient element in the data-parallel reduction (gradients reduced in fp32).
REDUCE_BYTES = 4


def reductions_per_step(zero: int, m: int, pipelined: bool) -> int:
    """Gradient reductions a data-parallel rank runs per step (module docstring): m
    reduce-scatters for ZeRO-2 over m > 1 micro-batches without a pipeline, else one."""
    return m if zero == 2 and m > 1 and not pipelined else 1


def gathers_back(zero: int, shared: bool) -> bool:
    """Is the gradient sync a reduce-scatter whose updated parameters are gathered back
    behind the next forward (ZeRO-1/2, module docstring)? Not on ranks sharing CPU cores,
    where the measured runs rank right with one all-reduce (:meth:`StepModel._syncs`)."""
    return zero in (1, 2) and not shared


def _reduction(zero: int, reps: int, shared: bool = False) -> str:
    """The gradient collective of A_d: a reduce-scatter where the optimizer is sharded and
    gathers back (:func:`gathers_back`) or when reducing every micro-batch, else one
    all-reduce."""
    return "reduce_scatter" if gathers_back(zero, shared) or reps > 1 else "all_reduce"


def memory_zero(zero: int, m: int, pipelined: bool) -> int:
    """The ZeRO stage whose bytes a rank holds: ZeRO-2 in a pipeline over m > 1
    micro-batches accumulates unsharded gradients, ZeRO-1's (module docstring)."""
    return 1 if zero == 2 and m > 1 and pipelined else zero


@dataclass(frozen=True)
class ParamBucket:
    """``count`` local parameters (after tensor sharding) per device whose gradients are
    summed, and ZeRO shards their states, over ``group``: the group along mesh axes
    ``axes`` (buckets of different axes stay apart even where their groups have the same
    shape: each is its own collective)."""

    axes: tuple
    count: float
    group: Group


@dataclass(frozen=True)
class ChunkCost:
    """One chunk, per micro-batch and device (module docstring)."""

    fwd: float                  # compute seconds
    bwd: float
    tp_fwd: float               # in-layer communication seconds
    tp_bwd: float
    send: float                 # the output's send to the next chunk (0 for the last)
    act: float                  # activation bytes kept for backward
    recompute_peak: float       # one recomputed layer's full activations (bytes)
    checkpoint: bool            # blocks recomputed in backward
    buckets: tuple[ParamBucket, ...]
    gathered: float             # largest layer's parameter bytes, gathered (ZeRO-3)
    zero: int
    devices: int                # the chunk's submesh size
    cpu_tp_fwd: float = 0.0     # in-layer communication as issued on shared CPU cores
    cpu_tp_bwd: float = 0.0
    modules: int = 0            # FSDP units (the chunk's root and its blocks)
    transient: float = 0.0      # temporaries (bytes): fp32 loss, pipeline send/recv buffers
    selective: float = 0.0      # a: attention-core forward seconds recomputed (selective)
    tp_overlap: int = 0         # n: TP collectives decomposed beside their GEMMs (0: off)
    tp_overlap_backward: float = 0.0  # c: backward-only overlap's share (0: off)
    gemm_fwd: float = 0.0       # g_f, g_b: compute seconds of the TP-sharded GEMMs
    gemm_bwd: float = 0.0

    @property
    def tp_paid(self) -> tuple[float, float]:
        """(forward, backward) in-layer communication seconds the step pays: tp_f, tp_b, or
        under TP-communication overlap paid(tp, g, n), or under the backward-only overlap
        tp_f, paid_bwd(tp_b, g_b, c) (module docstring)."""
        if self.tp_overlap:
            return (paid(self.tp_fwd, self.gemm_fwd, self.tp_overlap),
                    paid(self.tp_bwd, self.gemm_bwd, self.tp_overlap))
        if self.tp_overlap_backward:
            return self.tp_fwd, paid_backward(self.tp_bwd, self.gemm_bwd,
                                              self.tp_overlap_backward)
        return self.tp_fwd, self.tp_bwd

    @property
    def recompute(self) -> float:
        """Compute seconds recomputed per micro-batch: t_f (full), a (selective) or 0."""
        return self.fwd if self.checkpoint else self.selective

    @property
    def work(self) -> float:
        """T_c less its pipeline boundaries: seconds of one micro-batch's forward and
        backward on the chunk's devices (:func:`path_times` adds the boundaries)."""
        tp_f, tp_b = self.tp_paid
        t = self.fwd + self.bwd + tp_f + tp_b + self.recompute
        if self.checkpoint:
            t += tp_f
        return t

    def stage_time(self) -> StageTime:
        r = self.checkpoint
        tp_f, tp_b = self.tp_paid
        return StageTime(forward=self.fwd, backward=self.bwd,
                         recompute=self.recompute, tp_forward=tp_f,
                         tp_backward=tp_b, tp_recompute=tp_f if r else 0.0,
                         send=self.send)


def _received(chunks: Sequence[ChunkCost]) -> list[float]:
    """s(c - 1) of each chunk: the send of the chunk before it in stage order (0 first)."""
    return [0.0] + [c.send for c in chunks[:-1]]


def path_times(chunks: Sequence[ChunkCost]) -> list[float]:
    """T_c of each chunk in stage order (module docstring): its work, its output's boundary
    s(c) and its input's s(c - 1), once each per micro-batch."""
    return [c.work + c.send + r for c, r in zip(chunks, _received(chunks))]


@dataclass(frozen=True)
class Workload:
    """What the step does beyond its chunks: m micro-batches of ``samples`` samples in
    all, ``tokens`` tokens, FLOPs counted without and with recomputation."""

    num_micro_batches: int
    schedule: str
    virtual_stages: int
    samples: int
    tokens: int
    model_flops: float
    recompute_flops: float


class StepModel:
    """The composition of the module docstring for one cost model (compute, communication,
    precision, device), with its shared-core and calibration properties."""

    def __init__(self, compute: ComputeModel, comm: CommModel, *, precision: str,
                 memory_limit_bytes: float, peak_flops: float,
                 shared: SharedCores | None = None, calibration=None):
        if precision not in PRECISION_BYTES:
            raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, "
                             f"got {precision!r}")
        self.compute = compute
        self.comm = comm
        self.gpu = not compute.device.name.lower().startswith("cpu")
        self.precision = precision
        self.param_bytes = PRECISION_BYTES[precision][0]
        self.memory_limit_bytes = memory_limit_bytes
        self.peak_flops = peak_flops
        self.shared = shared if shared is not None and shared.share < 1 else None
        self.calibration = calibration if calibration is not None and \
            not calibration.is_identity else None
        self._times: dict[tuple, float] = {}
        #: predicted / modelled step: 1 + the GPU runtime overhead (:mod:`autoplan.cost.runtime`)
        self.runtime_factor = runtime_factor(gpu=self.gpu, calibrated=self.calibration is not None)

    def _comm_time(self, collective: str, nbytes: float, group: Group) -> float:
        """``CommModel.time``, remembered (a grid asks for the same few many times)."""
        key = (collective, nbytes, group)
        hit = self._times.get(key)
        if hit is None:
            hit = self._times[key] = self.comm.time(collective, nbytes, group)
        return hit

    # ---- data parallelism of one pipeline rank ------------------------------------------
    def _syncs(self, buckets: Sequence[ParamBucket], zero: int, m: int = 1,
               pipelined: bool = False, shared: bool = False) -> tuple[float, float, float]:
        """(A_d, G_d, local parameters the optimizer steps) of the module docstring; A_d is
        m R_d for ZeRO-2 over m > 1 micro-batches without a pipeline; G_d is one gather of
        the rank's parameters (ZeRO >= 1; ZeRO-3 gathers it twice per micro-batch).

        ``shared`` (ranks sharing CPU cores): A_d one all-reduce per step and no separate
        ZeRO-1/2 gather, which is what the measured runs rank right. On gloo the link
        profile prices a reduce-scatter plus an all-gather at twice the all-reduce (34 MB on
        4 ranks: 53 + 30 ms against 41 ms), yet ZeRO-1 measured no slower than ZeRO-0
        (``benchmarks/cost_model_accuracy.py``, 2026-11-28: 0.67 s against 0.78 s a step;
        priced as reduce-scatter + gather the rank correlation fell from 0.96 to 0.93 and
        the median error rose from 7% to 12%)."""
        reps = reductions_per_step(zero, m, pipelined)
        sharded = gathers_back(zero, shared)
        reduce = _reduction(zero, reps, shared)
        t_reduce = t_gather = local = 0.0
        for b in buckets:
            if b.group.size > 1 and b.count > 0:
                t_reduce += reps * self._comm_time(reduce, b.count * REDUCE_BYTES, b.group)
                if sharded or zero == 3:
                    t_gather += self._comm_time("all_gather", b.count * self.param_bytes,
                                                b.group)
            local += b.count / b.group.size if zero >= 1 else b.count
        return t_reduce, t_gather, local

    def _dp_exposed(self, chunks: Sequence[ChunkCost], buckets: Sequence[ParamBucket],
                    zero: int, m: int, t_reduce: float, pipelined: bool = False,
                    t_gather: float = 0.0) -> float:
        """E_d: exposed data-parallel seconds of one pipeline rank (module docstring).

        ZeRO 0-2: the step's gradient reduction in buckets over the last micro-batch's
        backward (:func:`autoplan.cost.overlap.bucketed_reduction`); ZeRO-2 over m > 1
        micro-batches without a pipeline: a reduce-scatter so over every micro-batch's
        backward; ZeRO-1/2 add the parameters' all-gather (``t_gather``) in units over the
        first micro-batch's forward (module docstring). ZeRO-3: per micro-batch,
        the per-unit all-gathers (forward and backward) and reduce-scatters of
        :func:`autoplan.cost.overlap.zero3_micro_batch`, the rank's chunks' units (FSDP's
        wrapped modules: ``ChunkCost.modules``) sharing its parameters and compute equally."""
        synced = [b for b in buckets if b.group.size > 1 and b.count > 0]
        if not synced:
            return 0.0
        bwd = sum(c.bwd for c in chunks)
        units = max(1, sum(c.modules for c in chunks))
        if zero < 3:                  # reps reductions, each over one micro-batch's backward
            reps = reductions_per_step(zero, m, pipelined)
            reduce = _reduction(zero, reps)
            last = sum(self.comm.time(reduce, min(b.count * REDUCE_BYTES, DDP_BUCKET_BYTES),
                                      b.group) for b in synced)
            exposed = reps * bucketed_reduction(t_reduce / reps, bwd, last)
            if zero >= 1:             # the updated parameters, gathered unit by unit
                first = sum(self.comm.time("all_gather", b.count / units * self.param_bytes,
                                           b.group) for b in synced)
                exposed += bucketed_reduction(t_gather, sum(c.fwd for c in chunks), first)
            return exposed
        gather = sum(self.comm.time("all_gather", b.count / units * self.param_bytes, b.group)
                     for b in synced)
        scatter = sum(self.comm.time("reduce_scatter", b.count / units * REDUCE_BYTES, b.group)
                      for b in synced)
        tp = [c.tp_paid for c in chunks]
        fwd = sum(c.fwd + f for c, (f, _) in zip(chunks, tp)) / units
        back = sum(c.bwd + b + c.recompute + (f if c.checkpoint else 0.0)
                   for c, (f, b) in zip(chunks, tp)) / units
        return m * zero3_micro_batch(units, gather, scatter, fwd, back)

    def _memory(self, chunks: Sequence[ChunkCost], buckets: Sequence[ParamBucket],
                in_flight: float, zero: int, pipelined: bool = False) -> MemoryBreakdown:
        params = grads = optim = 0.0
        for b in buckets:
            s = model_state_bytes(b.count, dp=b.group.size, zero=zero, precision=self.precision)
            params += s.params
            grads += s.grads
            optim += s.optimizer
        acts = in_flight * sum(c.act for c in chunks)
        acts += max((c.recompute_peak for c in chunks), default=0.0)
        return MemoryBreakdown(params=params, grads=grads, optimizer=optim, activations=acts,
                               other=self._other(chunks, buckets, zero, acts, pipelined))

    def _other(self, chunks: Sequence[ChunkCost], buckets: Sequence[ParamBucket], zero: int,
               acts: float, pipelined: bool) -> float:
        """Bytes beyond model states and activations (:mod:`autoplan.cost.memory`): the CUDA
        context and NCCL's buffers of each communicator the rank uses, the temporaries of
        its chunks (fp32 loss, pipeline buffers), ZeRO-3's gathered units (the current and
        the prefetched one) and a unit's fp32 gradient buffer for its reduce-scatter, and
        the allocator's reserve over the transient bytes. On CPU only the ZeRO-3 buffers
        (no CUDA context, NCCL or caching allocator)."""
        synced = any(b.group.size > 1 and b.count > 0 for b in buckets)
        gathered = max(c.gathered for c in chunks) if zero == 3 and synced else 0.0
        zero3 = 2 * gathered + gathered / self.param_bytes * REDUCE_BYTES
        if not self.gpu:
            return 2 * gathered
        communicators = 1 + synced + any(c.tp_fwd > 0 or c.tp_bwd > 0 for c in chunks) \
            + pipelined
        transient = sum(c.transient for c in chunks)
        return (runtime_bytes(communicators) + transient + zero3
                + fragmentation_bytes(acts + transient + zero3))

    # ---- the step -----------------------------------------------------------------------
    def compose(self, chunks: Sequence[ChunkCost], work: Workload) -> Prediction:
        """The prediction of a step whose chunk c runs on pipeline rank c mod pp."""
        v = work.virtual_stages
        pp = len(chunks) // v
        m = work.num_micro_batches
        ranks = [list(chunks[d::pp]) for d in range(pp)]
        paths = path_times(chunks)
        rank_time = [sum(paths[d::pp]) for d in range(pp)]
        slow = max(range(pp), key=lambda d: rank_time[d])
        if v == 1:
            pipeline = sum(rank_time) + (m - 1) * rank_time[slow]
        else:
            pipeline = m * rank_time[slow] + (pp - 1) * rank_time[slow] / v
        sc = ranks[slow]
        compute = m * sum(c.fwd + c.bwd for c in sc)
        recompute = m * sum(c.recompute for c in sc)
        tp_comm = m * sum(f + b + (f if c.checkpoint else 0.0)
                          for c, (f, b) in ((c, c.tp_paid) for c in sc))
        pp_comm = m * sum(c.send + r for c, r in zip(sc, _received(chunks)[slow::pp]))
        bubble = max(0.0, pipeline - compute - recompute - tp_comm - pp_comm)

        dp_exposed, opt_time, per_rank, syncs = [], [], [], []
        for d, cs in enumerate(ranks):
            zero = cs[0].zero
            buckets = _merge([b for c in cs for b in c.buckets])
            t_reduce, t_gather, local = self._syncs(buckets, zero, m, pp > 1)
            dp_exposed.append(self._dp_exposed(cs, buckets, zero, m, t_reduce, pp > 1,
                                               t_gather))
            opt_time.append(self.compute.optimizer_time(local))
            if self.shared is not None:
                syncs.append(self._syncs(buckets, zero, m, pp > 1, shared=True))
            in_flight = in_flight_weighted(work.schedule, pp, d, m, v, [c.act for c in cs])
            per_rank.append(self._memory(cs, buckets, in_flight, memory_zero(zero, m, pp > 1),
                                         pp > 1))
        dp_comm = max(dp_exposed)
        optimizer = max(opt_time)
        step = pipeline + dp_comm + optimizer
        runtime = (self.runtime_factor - 1.0) * step
        step += runtime
        time = TimeBreakdown(compute=compute, recompute=recompute, tp_comm=tp_comm,
                             dp_comm=dp_comm, pp_comm=pp_comm, bubble=bubble,
                             optimizer=optimizer, runtime=runtime)
        if self.shared is not None:
            step, time = self._shared_cores(ranks, syncs, m, step)
        world = sum(cs[0].devices for cs in ranks)
        pred = Prediction(
            step_time_s=step, tokens_per_s=work.tokens / step,
            samples_per_s=work.samples / step,
            model_tflops_per_device=work.model_flops / step / world / 1e12,
            hardware_tflops_per_device=(work.model_flops + work.recompute_flops)
            / step / world / 1e12,
            mfu=work.model_flops / step / world / self.peak_flops,
            memory=max(per_rank, key=lambda mb: mb.total),
            memory_limit_bytes=self.memory_limit_bytes, time=time,
            memory_per_stage=tuple(per_rank),
            stage_times=tuple(c.stage_time() for c in chunks))
        return self.calibration.apply(pred) if self.calibration is not None else pred

    def _shared_cores(self, ranks: list[list[ChunkCost]],
                      syncs: list[tuple[float, float, float]], m: int, step: float
                      ) -> tuple[float, TimeBreakdown]:
        """``max(T_cap, s x step)`` (module docstring), and the mean rank's breakdown."""
        sh = self.shared
        keys = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "optimizer")
        work = []
        for cs, (t_reduce, t_gather, local) in zip(ranks, syncs):
            w = dict.fromkeys(keys, 0.0)
            for c in cs:
                w["compute"] += m * (c.fwd + c.bwd)
                w["recompute"] += m * c.recompute
                w["tp_comm"] += m * (c.cpu_tp_fwd + c.cpu_tp_bwd +
                                     (c.cpu_tp_fwd if c.checkpoint else 0.0))
                w["pp_comm"] += m * 2 * c.send
            if t_reduce > 0:         # data parallel: FSDP's per-module work, and in full
                w["dp_comm"] += m * sum(c.modules for c in cs) * sh.dp_module_overhead_s \
                    / sh.share
                w["dp_comm"] += t_reduce
                w["dp_comm"] += m * 2 * t_gather
            w["optimizer"] = sh.optimizer_scale * self.compute.optimizer_time(local)
            work.append((cs[0].devices, w))
        sizes = {n for n, _ in work}
        if len(sizes) == 1:          # equal submeshes: the mean over pipeline ranks
            avg = {k: sum(w[k] for _, w in work) / len(work) for k in keys}
        else:                        # a mean over devices
            devices = sum(n for n, _ in work)
            avg = {k: sum(n * w[k] for n, w in work) / devices for k in keys}
        capacity = sum(avg.values())
        out = max(capacity, sh.share * step)
        return out, TimeBreakdown(**avg, bubble=out - capacity)


def _merge(buckets: list[ParamBucket]) -> list[ParamBucket]:
    """Buckets of one rank's chunks summed per axes (in chunk order), sorted by axes."""
    out: dict[tuple, ParamBucket] = {}
    for b in buckets:
        have = out.get(b.axes)
        out[b.axes] = ParamBucket(b.axes, (have.count if have else 0.0) + b.count, b.group)
    return [out[k] for k in sorted(out, key=lambda axes: (len(axes), axes))]
