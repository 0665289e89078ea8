"""The uniform planner: enumerate the DP x TP x PP (x CP, x EP) space and rank by predicted time.

Every layer gets the same treatment (Megatron-LM style), so a configuration is a
:class:`ParallelConfig`: tensor-parallel degree ``tp`` (inside a node, dividing every sharded
dimension and the head counts), pipeline degree ``pp`` (at most one block per chunk), data
parallel ``dp = world / (tp·pp)`` (dividing the global batch), ZeRO stage 0-3 (only with
dp > 1), sequence parallelism (only with tp > 1), micro-batch size ``b`` (dividing the per-rank
batch) and count ``m = B / (dp·b)`` (at least ``pp`` when pipelining), recomputation none,
selective or full (:mod:`autoplan.cost.recompute`; selective only where a block keeps
attention matrices: with fused attention it saves no memory and costs time, so it never
wins), TP-communication overlap on or off when the space asks for it (GPU clusters, tp > 1
with sequence parallelism, no ep or cp: :mod:`autoplan.cost.tp_overlap`; the engine does not
run it, so only plans for the exporters do), and the schedule (GPipe, 1F1B, interleaved 1F1B with v chunks when the blocks and
micro-batches divide), context parallelism ``cp`` for long sequences (:func:`context_degrees`;
``dp = world / (tp·pp·cp)``) and expert parallelism ``ep`` for mixtures of experts (folded
into data parallelism, :func:`expert_degrees`). Candidates that exceed device memory are dropped; the rest are sorted
by predicted step time (ties: less memory, then the label, so the result is deterministic).

This is the baseline every later solver must beat.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from autoplan.cluster import Cluster
from autoplan.errors import InfeasibleError
from autoplan.graph import OpGraph
from autoplan.plan import ParallelConfig, Prediction
from autoplan.plan_parts import PARTIAL_RECOMPUTE
from autoplan.planner.grid.estimate import Estimator, divisors, fits
from autoplan.schedule import runs_micro_batches

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Restrictions of the uniform space; ``None`` means every valid value."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch: tuple[int, ...] | None = None
    # "op" (torchtitan's op-level policy) is priced and run, but enumerated only when asked:
    # Megatron-LM and DeepSpeed cannot express it
    checkpoint: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")
    virtual_stages: tuple[int, ...] = (2, 4)
    sequence_parallel: tuple[bool, ...] = (False, True)
    tp_with_pp: bool = True                 # False: tensor parallelism only without pipelines
    checkpoint_with_pp: bool = True         # False: recomputation only without pipelines
    ep: tuple[int, ...] | None = None       # default: every divisor of dp and of the experts
    cp: tuple[int, ...] | None = None       # default: context_degrees()
    # TP-communication overlap where it applies (enumerate_configs); off by default, as the
    # engine does not run it: ``autoplan plan --tp-comm-overlap`` plans for the exporters
    tp_comm_overlap: tuple[bool, ...] = (False,)


#: Context parallelism is considered while every rank keeps at least this many tokens of a
#: sequence: it is a long-context technique (Llama 3 trained 131,072-token sequences with
#: cp 16, i.e. 8,192 tokens a rank, and its 8K stage without it; Dubey et al. 2024, sec.
#: 3.3.2, Table 4). Shorter sequences keep the layouts the engine runs today.
MIN_CP_TOKENS = 8192


def context_degrees(graph: OpGraph, world: int) -> list[int]:
    """cp degrees worth pricing: 1, and powers of two up to 64 that cut the sequence into
    ``2 cp`` equal chunks of at least MIN_CP_TOKENS / 2, when every block has
    scaled-dot-product attention (whose keys and values the ranks exchange)."""
    seq = graph.batch.seq_len
    blocks = graph.blocks()
    if not seq or not blocks or any(layer.stats.kv_bytes == 0 for layer in blocks):
        return [1]
    return [1] + [c for c in (2, 4, 8, 16, 32, 64)
                  if c <= world and seq % (2 * c) == 0 and seq // c >= MIN_CP_TOKENS]


def expert_degrees(graph: OpGraph, dp: int) -> list[int]:
    """ep degrees: divisors of dp that split the experts evenly (1 for dense models)."""
    experts = graph.experts
    return [e for e in divisors(dp) if experts and experts % e == 0] or [1]


@dataclass(frozen=True)
class Candidate:
    parallel: ParallelConfig
    prediction: Prediction

    @property
    def fits(self) -> bool:
        return fits(self.prediction)

    def summary(self) -> dict:
        pred = self.prediction
        return {"parallel": self.parallel.label(), "config": _asdict(self.parallel),
                "step_time_s": pred.step_time_s, "mfu": pred.mfu,
                "memory_gb": pred.memory.total / GB, "fits": self.fits,
                "time": pred.time.to_dict()}


@dataclass
class SearchResult:
    best: Candidate
    ranked: list[Candidate]                 # feasible, fastest first
    evaluated: int
    feasible: int
    seconds: float
    closest_infeasible: Candidate | None = None
    notes: list[str] = field(default_factory=list)
    priced: int | None = None              # configurations priced exactly (None: all)


def tp_degrees(graph: OpGraph, cluster: Cluster, divides: tuple[int, ...] = ()) -> list[int]:
    """TP degrees inside one node that divide every TP-sharded dimension and ``divides``
    (e.g. the attention head counts)."""
    sharded = [info.shape[info.tp_dim] for info in graph.params.values()
               if info.tp_dim is not None]
    out = []
    for t in divisors(cluster.devices_per_node):
        if all(d % t == 0 for d in sharded) and all(k % t == 0 for k in divides):
            out.append(t)
    return out


def enumerate_configs(graph: OpGraph, cluster: Cluster, global_batch: int,
                      space: SearchSpace = SearchSpace(), divides: tuple[int, ...] = ()):
    """Yield every valid ParallelConfig of the space (see module docstring)."""
    world = cluster.world_size
    blocks = len(graph.blocks())
    seq = graph.batch.seq_len
    checkpoints = [c for c in space.checkpoint
                   if c != "selective" or any(l.stats.saved_bytes_attn for l in graph.blocks())]
    gpu = not cluster.device.name.lower().startswith("cpu")
    cps = [c for c in context_degrees(graph, world) if space.cp is None or c in space.cp]
    for tp in tp_degrees(graph, cluster, divides):
        if space.tp is not None and tp not in space.tp:
            continue
        for pp, cp in ((pp, cp) for pp in (divisors(world // tp) if world % tp == 0 else [])
                       for cp in cps if (world // tp // pp) % cp == 0):
            if pp > max(blocks, 1) or (space.pp is not None and pp not in space.pp):
                continue
            if tp > 1 and pp > 1 and not space.tp_with_pp:
                continue
            dp = world // (tp * pp * cp)
            if global_batch % dp or (space.dp is not None and dp not in space.dp):
                continue
            eps = [e for e in expert_degrees(graph, dp) if space.ep is None or e in space.ep]
            per_rank = global_batch // dp
            for b in divisors(per_rank):
                if space.micro_batch is not None and b not in space.micro_batch:
                    continue
                m = per_rank // b
                few = not runs_micro_batches("1f1b", pp, m)
                if few and "gpipe" not in space.schedules:
                    continue
                schedules = [("1f1b", 1)]
                if few:                      # GPipe runs any m: every stage holds all m
                    schedules = [("gpipe", 1)]
                elif pp > 1:
                    schedules = [(s, 1) for s in space.schedules if s != "interleaved_1f1b"]
                    if "interleaved_1f1b" in space.schedules:
                        schedules += [("interleaved_1f1b", v) for v in space.virtual_stages
                                      if blocks >= pp * v and m % pp == 0]
                for zero in space.zero if dp * cp > 1 else (0,):
                    for sp in space.sequence_parallel if tp > 1 else (False,):
                        if sp and seq is not None and seq % tp:
                            continue
                        if sp and seq is not None and (seq // cp) % tp:
                            continue
                        for ckpt, (sched, v), ep, ov in (
                                (c, s, e, o) for c in checkpoints for s in schedules
                                for e in eps for o in space.tp_comm_overlap
                                if (not o or (gpu and sp and e == 1 and cp == 1)) and
                                (c == "none" or pp == 1 or space.checkpoint_with_pp)):
                            yield ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero,
                                                 sequence_parallel=sp, micro_batch=b,
                                                 num_micro_batches=m, schedule=sched,
                                                 virtual_stages=v, checkpoint=ckpt, ep=ep,
                                                 cp=cp, tp_comm_overlap=ov)


def search_uniform(graph: OpGraph, cluster: Cluster, global_batch: int, *,
                   space: SearchSpace = SearchSpace(), precision: str = "mixed",
                   divides: tuple[int, ...] = (), estimator: Estimator | None = None,
                   progress=None, keep: int | None = None) -> SearchResult:
    """Evaluate the configurations; raise InfeasibleError (with what would fit) if none fits.

    ``keep``: how many of the fastest fitting configurations the caller needs exactly (the
    best and its alternatives); None prices every configuration. With ``keep``, the
    configurations are priced in the order of a lower bound of their step time
    (:meth:`~autoplan.planner.grid.estimate.Estimator.step_lower_bound`, the pipeline term, from
    cached per-layer sums) and the pricing stops at the first whose bound exceeds the
    ``keep``-th fastest fitting step time found: no configuration left can rank among the
    first ``keep`` (branch and bound). ``ranked`` and ``feasible`` then cover the priced
    configurations; ``evaluated`` counts them all."""
    start = time.perf_counter()
    est = estimator or Estimator(graph, cluster, precision=precision)
    feasible: list[Candidate] = []
    closest: Candidate | None = None
    configs = list(enumerate_configs(graph, cluster, global_batch, space, divides))
    if not configs:
        raise InfeasibleError(_refusal(graph, cluster, global_batch, space, divides))
    bounded = keep is not None and est.exact_pipeline_bound
    if bounded:
        bounds = [est.step_lower_bound(cfg) for cfg in configs]
        order = sorted(range(len(configs)), key=bounds.__getitem__)
    else:
        order = range(len(configs))
    times: list[float] = []              # fitting step times found, ascending (bounded)
    priced = 0
    for i in order:
        if bounded and len(times) >= keep and bounds[i] > times[keep - 1] * (1 + 1e-12):
            break
        cand = Candidate(configs[i], est.predict(configs[i]))
        priced += 1
        if cand.fits:
            feasible.append(cand)
            if bounded:
                bisect.insort(times, cand.prediction.step_time_s)
        elif closest is None or cand.prediction.memory.total < closest.prediction.memory.total:
            closest = cand
        if progress is not None:
            progress(priced)
    if progress is not None:
        progress(len(configs))
    if not feasible:
        raise InfeasibleError(explain_infeasible(closest, cluster))
    feasible.sort(key=lambda c: (c.prediction.step_time_s, c.prediction.memory.total,
                                 c.parallel.label()))
    return SearchResult(best=feasible[0], ranked=feasible, evaluated=len(configs),
                        feasible=len(feasible), seconds=time.perf_counter() - start,
                        closest_infeasible=closest, priced=priced)


def _refusal(graph: OpGraph, cluster: Cluster, global_batch: int, space: SearchSpace,
             divides: tuple[int, ...]) -> str:
    """Why :func:`enumerate_configs` yields nothing: the rules that removed the (tp, pp)
    splits of the devices, each with how many it removed (the first failing rule of each
    split, in :func:`enumerate_configs`' order)."""
    world, blocks = cluster.world_size, max(len(graph.blocks()), 1)
    tps = tp_degrees(graph, cluster, divides)
    rules = {"pp": f"more pipeline stages than the model's {blocks} blocks",
             "dp": "the global batch is not divisible by the data-parallel degree dp",
             "m": "fewer micro-batches than pipeline stages (m = batch / (dp b) <= "
                  "batch / dp < pp; 1F1B needs m >= pp, and GPipe, which does not, is "
                  "outside the search space)",
             "space": "outside the search space"}
    failed = dict.fromkeys(rules, 0)
    for tp in tps:
        for pp in divisors(world // tp) if world % tp == 0 else []:
            dp = world // (tp * pp)
            rule = ("space" if (space.tp is not None and tp not in space.tp)
                    or (space.pp is not None and pp not in space.pp)
                    or (space.dp is not None and dp not in space.dp) else
                    "pp" if pp > blocks else "dp" if global_batch % dp else
                    "m" if pp > 1 and global_batch // dp < pp
                    and "gpipe" not in space.schedules else "space")
            failed[rule] += 1
    said = "; ".join(f"{n} of them: {rules[r]}" for r, n in failed.items() if n)
    return (f"no valid configuration of {world} devices for global batch {global_batch}: "
            f"of the {sum(failed.values())} splits into tensor-parallel degrees {tps} (those "
            f"that divide the model's sharded dimensions) and pipeline stages, {said}")


def explain_infeasible(closest: Candidate, cluster: Cluster) -> str:
    """Which constraint binds -- memory per device: needed vs available, for the candidate
    that needs the least -- and what would make it fit: the levers that candidate does not
    pull yet (ZeRO-3, activation checkpointing, a smaller micro-batch), and more devices. The
    device count is what lets the model states (parameters, gradients, optimizer), which
    shard over devices, fit beside what does not shard (activations, buffers)."""
    mem = closest.prediction.memory
    limit = closest.prediction.memory_limit_bytes
    p = closest.parallel
    uses = {"ZeRO-3": p.zero == 3, "full activation checkpointing": p.checkpoint == "full",
            "micro-batch 1": p.micro_batch == 1}
    pulled = [name for name, used in uses.items() if used]
    hints = []
    if p.zero < 3 and p.dp > 1:                 # ZeRO shards over data-parallel ranks only
        hints.append("ZeRO-3")
    if p.checkpoint != "full":
        hints.append("full activation checkpointing" if p.checkpoint in PARTIAL_RECOMPUTE
                     else "activation checkpointing")
    if p.micro_batch > 1:
        hints.append("a smaller micro-batch")
    states = mem.params + mem.grads + mem.optimizer
    unsharded = mem.activations + mem.other
    if unsharded < limit:
        devices = math.ceil(cluster.world_size * states / (limit - unsharded))
        hints.append(f"at least {devices} devices instead of {cluster.world_size} (the "
                     f"model states, {size_text(states)} per device here, shard over them)")
    else:
        hints.append(f"a shorter sequence or a smaller model: activations and buffers alone "
                     f"need {size_text(unsharded)} per device, so more devices will not do")
    return (f"model does not fit: memory per device is the binding constraint. The "
            f"configuration needing the least memory ({p.label()}) needs "
            f"{size_text(mem.total)} per device (params {size_text(mem.params)}, grads "
            f"{size_text(mem.grads)}, optimizer {size_text(mem.optimizer)}, activations "
            f"{size_text(mem.activations)}, other {size_text(mem.other)}) but each "
            f"{cluster.device.name} has {size_text(limit)}"
            + (f"; it already uses {', '.join(pulled)}" if pulled else "")
            + "; to make it fit use " + ", or ".join(hints))


def size_text(nbytes: float) -> str:
    """Bytes in GB (1e9 bytes), or in MB / kB when smaller, to one decimal."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e3:.1f} kB"


def _asdict(p: ParallelConfig) -> dict:
    from dataclasses import asdict

    return asdict(p)
