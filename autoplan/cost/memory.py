"""Memory cost: model states (ZeRO), activations per layer, pipeline in-flight counts.

Model states (Rajbhandari et al. 2019, "ZeRO", arXiv 1910.02054, sec. 3.1 and 5): with
mixed-precision Adam a parameter costs 2 bytes (fp16/bf16 copy) + 2 (gradient) + K = 12
(fp32 master copy, momentum, variance) = 16 bytes. Over N_d data-parallel ranks:

    ZeRO-0: 16 psi     ZeRO-1: 4 psi + 12 psi / N_d     ZeRO-2: 2 psi + 14 psi / N_d
    ZeRO-3: 16 psi / N_d

(psi = 7.5e9, N_d = 64: 120, 31.4, 16.6, 1.9 GB per device). Plain fp32 Adam keeps 4 (param)
+ 4 (grad) + 8 (momentum, variance) bytes per parameter, sharded the same way. Tensor and
pipeline parallelism divide psi before ZeRO does (``params_sharded_by``).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198, sec. 4): per transformer layer and micro-batch, in
bytes with 16-bit activations, sequence s, micro-batch b, hidden h, heads a, TP degree t:

    no parallelism          s b h (34 + 5 a s / h)
    tensor parallel         s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence par.  s b h (34 + 5 a s / h) / t
    full recomputation      2 s b h   (the layer input only; / t under sequence parallelism)
    selective recomputation s b h 34 (/ t with SP): the attention core's 5 a s / h dropped,
                            recomputed in backward (sec. 5; :mod:`autoplan.cost.recompute`)

The traced graph gives these terms directly: ``LayerStats.saved_bytes`` is the whole sum,
``saved_bytes_tp`` the part TP shards (24 + 5as/h), ``saved_bytes_attn`` the attention
matrices (5as/h, not stored by flash attention), ``input_bytes`` the layer input (2sbh).

Pipeline in-flight micro-batches (how many micro-batches' activations a stage holds at its
peak): GPipe (Huang et al. 2019) all m; 1F1B (PipeDream-Flush, Narayanan et al. 2021)
min(p - stage, m); interleaved 1F1B (Narayanan et al. SC'21, arXiv 2104.04473, sec. 2.2.2)
see :func:`in_flight_micro_batches`.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping

from autoplan.graph import LayerStats
from autoplan.plan import SCHEDULES, MemoryBreakdown
from autoplan.precision import PRECISIONS
from autoplan.schedule import round_size

#: Bytes per parameter: (params, grads, optimizer states) before any sharding.
#: From :mod:`autoplan.precision` (mixed and mixed-fp16: 2 + 2 + 12, fp32: 4 + 4 + 8).
PRECISION_BYTES: Mapping[str, tuple[float, float, float]] = MappingProxyType({
    name: tuple(float(b) for b in p.state_bytes) for name, p in PRECISIONS.items()})


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def model_state_bytes(num_params: float, *, dp: int, zero: int, precision: str = "mixed",
                      params_sharded_by: int = 1) -> MemoryBreakdown:
    """Bytes per device of parameters, gradients and optimizer states (``other`` = 0).

    ``num_params`` is the model's (or stage's) parameter count; ``params_sharded_by`` the
    factor TP (and anything else) divides it by before ZeRO shards over ``dp`` ranks.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, "
                         f"got {precision!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    _positive_int(dp, "dp")
    if not params_sharded_by >= 1:
        raise ValueError(f"params_sharded_by must be >= 1, got {params_sharded_by!r}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params!r}")
    psi = num_params / params_sharded_by
    p_bytes, g_bytes, o_bytes = PRECISION_BYTES[precision]
    return MemoryBreakdown(
        params=psi * p_bytes / (dp if zero >= 3 else 1),
        grads=psi * g_bytes / (dp if zero >= 2 else 1),
        optimizer=psi * o_bytes / (dp if zero >= 1 else 1),
    )


def activation_bytes(stats: LayerStats, *, tp: int = 1, sequence_parallel: bool = False,
                     checkpoint: bool = False, micro_batch_scale: float = 1.0,
                     flash_attention: bool = False, selective: bool = False) -> float:
    """Bytes one layer keeps for backward for one micro-batch, per device.

    Without recomputation: (saved - saved_tp) [/ tp under SP] + saved_tp / tp, minus the
    attention matrices with ``flash_attention`` (never stored) or ``selective`` (selective
    recomputation: recomputed in backward instead, Korthikanti et al. 2022 sec. 5; add
    :func:`selective_peak_bytes` once per stage). With ``checkpoint`` (full recomputation)
    only the layer input is kept ([/ tp under SP]); the recomputed layer's activations exist
    transiently during its backward -- add :func:`recompute_peak_bytes` once per stage.
    ``micro_batch_scale`` = micro-batch / traced batch (activations are linear in it).
    """
    _positive_int(tp, "tp")
    if micro_batch_scale <= 0:
        raise ValueError(f"micro_batch_scale must be > 0, got {micro_batch_scale!r}")
    replicated_div = tp if sequence_parallel else 1
    if checkpoint:
        return stats.input_bytes / replicated_div * micro_batch_scale
    sharded = float(stats.saved_bytes_tp)
    replicated = float(stats.saved_bytes - stats.saved_bytes_tp)
    if flash_attention or selective:
        # The attention matrices are per-head, so TP shards them; drop them from the sharded
        # part first, and from the rest if a graph attributed them elsewhere.
        attn = float(stats.saved_bytes_attn)
        from_sharded = min(attn, sharded)
        sharded -= from_sharded
        replicated = max(0.0, replicated - (attn - from_sharded))
    return (replicated / replicated_div + sharded / tp) * micro_batch_scale


def recompute_peak_bytes(stats: LayerStats, *, tp: int = 1, sequence_parallel: bool = False,
                         micro_batch_scale: float = 1.0, flash_attention: bool = False) -> float:
    """Transient bytes of one fully recomputed layer during its backward: its activations
    as without recomputation. A stage with checkpointed layers adds this once (the largest
    such layer), on top of the kept inputs of all in-flight micro-batches."""
    return activation_bytes(stats, tp=tp, sequence_parallel=sequence_parallel,
                            checkpoint=False, micro_batch_scale=micro_batch_scale,
                            flash_attention=flash_attention)


def selective_peak_bytes(stats: LayerStats, *, tp: int = 1, micro_batch_scale: float = 1.0,
                         flash_attention: bool = False) -> float:
    """Transient bytes of one layer's recomputed attention core during its backward under
    selective recomputation: its attention matrices (per head, so / tp), none with flash
    attention. A stage adds the largest once, like :func:`recompute_peak_bytes`."""
    _positive_int(tp, "tp")
    if flash_attention:
        return 0.0
    return float(stats.saved_bytes_attn) / tp * micro_batch_scale


def in_flight_weighted(schedule: str, pp: int, stage: int, num_micro_batches: int,
                       virtual_stages: int, chunk_bytes: "list[float] | tuple[float, ...]"
                       ) -> float:
    """Micro-batches of whole-stage activations pipeline rank ``stage`` holds at its peak
    when its ``v`` chunks keep different activations (``chunk_bytes``, the rank's chunks in
    order): ``max_t sum_c live_c(t) a_c / sum_c a_c`` over the schedule's order
    (:func:`autoplan.schedule.live_chunks`), where :func:`in_flight_micro_batches` counts
    every chunk forward as ``1/v`` of the stage. The two agree when the chunks are equal and
    always for ``v = 1``; they differ where the interleaved warm-up holds the first chunks
    more often than the last (a first chunk with the embedding, a last with the head)."""
    v = virtual_stages
    flat = in_flight_micro_batches(schedule, pp, stage, num_micro_batches, v)
    total = float(sum(chunk_bytes))
    if v == 1 or pp * v == 1 or total <= 0 or len(chunk_bytes) != v \
            or max(chunk_bytes) - min(chunk_bytes) <= 1e-9 * max(chunk_bytes):
        return flat                                  # equal chunks: the closed form
    from autoplan.schedule import live_chunks

    rows = live_chunks(schedule, pp, stage, num_micro_batches, v)
    return max(sum(n * a for n, a in zip(row, chunk_bytes)) for row in rows) / total


def in_flight_micro_batches(schedule: str, pp: int, stage: int, num_micro_batches: int,
                            virtual_stages: int = 1) -> float:
    """Micro-batches of *whole-stage* activations pipeline rank ``stage`` holds at its peak:
    the closed form of :func:`autoplan.schedule.peak_in_flight`, which counts it on the very
    order the engine runs (``tests/test_schedule.py`` checks the two agree).

    * one stage (``pp = v = 1``): forward and backward alternate: 1 (min(1, m)).
    * ``gpipe``: all forwards run before any backward: m.
    * ``1f1b``: rank r runs p - r - 1 warm-up forwards, then alternates one forward and one
      backward: min(p - r, m).
    * ``interleaved_1f1b`` with v model chunks per rank: the schedule runs
      w = 2(p - r - 1) + (v - 1) g warm-up forwards of *chunks* (each 1/v of the stage),
      with g the micro-batches per round (:func:`autoplan.schedule.round_size`: p when p
      divides m, as Megatron-LM requires; torch.distributed.pipelining's
      ``ScheduleInterleaved1F1B`` takes m / max(1, m // p) otherwise, so a round can be
      longer than p), and the peak is min(w + 1, m v) / v stage-micro-batches. With g = p
      on the first stage this is p (1 + (p - 1) / (p v)), Korthikanti et al. 2022 sec.
      4.2.3; v = 1 is plain 1F1B.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    _positive_int(pp, "pp")
    _positive_int(num_micro_batches, "num_micro_batches")
    _positive_int(virtual_stages, "virtual_stages")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage!r}")
    m, v = num_micro_batches, virtual_stages
    if pp * v == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:
        return float(min(pp - stage, m))
    warmup = 2 * (pp - stage - 1) + (v - 1) * round_size(pp, m)
    return min(warmup + 1, m * v) / v


# ---- overheads beyond model states and activations ------------------------------------------
#: CUDA context with PyTorch's kernels and library handles (cuBLAS, cuDNN) loaded, outside
#: the caching allocator: PyTorch's CUDA semantics notes put the context at 250-750 MB and
#: cuBLAS keeps a workspace per stream (CUBLAS_WORKSPACE_CONFIG default ":4096:8", 32 MiB).
CUDA_CONTEXT_BYTES = 750e6 + 32 * 2 ** 20
#: NCCL's per-channel receive buffers of one communicator: Simple NCCL_BUFFSIZE (4 MiB) +
#: LL128 (~4.6 MiB) + LL (256 KiB) per channel (NCCL env docs, NCCL_BUFFSIZE; tuning model
#: protocols), times the channels it opens (16 on NVSwitch nodes, NCCL_MAX_NCHANNELS).
NCCL_CHANNEL_BYTES = (4 + 4.6 + 0.25) * 2 ** 20
NCCL_CHANNELS = 16
#: Caching-allocator reserve over what tensors use: blocks rounded up (512 B, 2 MiB segments)
#: and freed blocks that do not fit later requests; PyTorch's memory stats typically show
#: reserved 5-10% above allocated during training with transient activations (torch.cuda
#: memory_stats, "Understanding CUDA Memory Usage"). 0.05 of the transient bytes, the low
#: end: the engine runs the allocator with expandable segments (``engine.run.
#: ALLOCATOR_SETTINGS``), which merges freed neighbours inside one growing mapping; and a
#: published run bounds it from above: Llama 3 405B trained 8K sequences at TP 8, PP 16
#: without activation checkpointing on 80 GB H100s (Llama 3 paper, arXiv 2407.21783, sec.
#: 3.3.2), which with this module's other terms leaves room for at most ~0.069 of its
#: second stage's 64.5 GB of activations (``tests/test_cost_memory.py``).
FRAGMENTATION = 0.05
#: Default fraction of device memory a plan leaves free for what no term models (a second
#: optimizer copy during checkpointing, profiler buffers, spikes); ``--memory-headroom``.
DEFAULT_HEADROOM = 0.02


def runtime_bytes(communicators: int) -> float:
    """CUDA context and NCCL buffers of one rank with ``communicators`` NCCL communicators
    (the default group plus one per parallel dimension > 1 the rank talks over)."""
    if isinstance(communicators, bool) or not isinstance(communicators, int) \
            or communicators < 0:
        raise ValueError(f"communicators must be an integer >= 0, got {communicators!r}")
    return CUDA_CONTEXT_BYTES + communicators * NCCL_CHANNELS * NCCL_CHANNEL_BYTES


def loss_temporaries_bytes(logits: float, tp: int = 1, *, eager: bool = False) -> float:
    """Transient bytes of the loss on the last stage over ``logits`` elements (micro-batch x
    sequence x vocabulary), the vocabulary sharded over TP (Megatron's vocab-parallel
    cross-entropy, torch's loss_parallel): one fp32 gradient of the log-softmax where the
    runtime fuses the loss's backward (torch.compile; Megatron's cross-entropy computes it
    in place of its saved softmax); two under ``eager`` PyTorch, whose backward holds the
    NLL's dense fp32 gradient and the log-softmax's fp32 input gradient at once
    (``nll_loss_backward`` then ``_log_softmax_backward_data``). The fp32 log-softmax itself
    is saved for backward and counted with the activations (the traced graph upcasts the
    logits before the loss). torchtitan's Llama 3.1 8B runs, whose loss ran eager (128k
    vocabulary, 16k tokens per micro-batch: 8.4 GB a tensor), measured 88.5 and 71.9 GB on 8
    and 128 H100s: predicted 85.7 and 70.7 GB with the second gradient, 76.9 and 61.9
    without (``benchmarks/published_runs.py``)."""
    _positive_int(tp, "tp")
    if logits < 0:
        raise ValueError(f"logits must be >= 0, got {logits!r}")
    return (8.0 if eager else 4.0) * logits / tp


def eager_loss(fused: bool, fused_loss: bool | None) -> bool:
    """Whether the loss's backward runs as eager PyTorch (two fp32 gradients,
    :func:`loss_temporaries_bytes`): ``fused_loss`` where given, else as the element-wise
    ops run (``fused``; :func:`autoplan.api.prepare`)."""
    return not (fused if fused_loss is None else fused_loss)


def pipeline_buffer_bytes(output_bytes: float, first: bool, last: bool) -> float:
    """Send/receive buffers of a pipeline stage for one micro-batch: it receives its input
    (and sends its input's gradient) unless first, sends its output (and receives its
    gradient) unless last -- one buffer of the boundary activation each way."""
    if output_bytes < 0:
        raise ValueError(f"output_bytes must be >= 0, got {output_bytes!r}")
    return output_bytes * (2 * (not first) + 2 * (not last))


def fragmentation_bytes(transient: float) -> float:
    """Allocator reserve over the transient (activation and temporary) bytes."""
    if transient < 0:
        raise ValueError(f"transient must be >= 0, got {transient!r}")
    return FRAGMENTATION * transient


def usable_bytes(capacity: float, headroom: float = DEFAULT_HEADROOM) -> float:
    """Device memory a plan may fill: ``capacity`` less the ``headroom`` fraction."""
    if not 0 <= headroom < 1:
        raise ValueError(f"memory headroom must be a fraction in [0, 1), got {headroom!r}")
    return capacity * (1 - headroom)


def temporary_bytes(graph, start: int, end: int, scale: float, shard: int = 1,
                    eager: bool = False) -> float:
    """Temporaries of the chunk of ``graph``'s layers [start, end) per micro-batch (``scale``
    x the traced one), its activations split ``shard`` ways: the loss's fp32 gradients if
    the chunk ends the model (the elements of its log-softmax; ``eager``:
    :func:`loss_temporaries_bytes`), and the pipeline buffers of its boundary activations
    (:func:`pipeline_buffer_bytes`)."""
    layers = graph.layers
    first, last = start == 0, end == len(layers)
    out = 0.0
    if last:
        logits = sum(math.prod(node.output_meta[0].shape) for name in layers[end - 1].nodes
                     if "log_softmax" in (node := graph.nodes[name]).op and node.output_meta)
        out += loss_temporaries_bytes(logits * scale, shard, eager=eager)
    if not (first and last):
        boundary = layers[end - 1].stats.output_bytes if not last else \
            layers[start].stats.input_bytes
        out += pipeline_buffer_bytes(boundary * scale / shard, first, last)
    return out


def solver_state_weight(gpu: bool = True) -> float:
    """Weight of the model states in a solver's memory constraint against
    :func:`solver_budget_bytes`: that budget is the usable bytes less the runtime's, over
    1 + the allocator reserve, which applies to the transient bytes only (activations,
    temporaries, ZeRO-3 buffers), not to the states allocated once. So a plan fits when
    ``w states + activations <= budget`` with w = 1 / (1 + FRAGMENTATION) on a GPU, the
    step's own memory up to the temporaries (1 on CPU: no reserve)."""
    return 1.0 / (1 + FRAGMENTATION) if gpu else 1.0


def solver_budget_bytes(limit: float, gpu: bool = True, communicators: int = 3) -> float:
    """Budget for a solver whose memory constraint counts model states, activations and
    ZeRO-3 buffers but not the overheads above: ``limit`` (the usable bytes) less the
    runtime bytes of ``communicators`` communicators, over 1 + the allocator reserve. The
    step's own memory (:mod:`autoplan.cost.step`) still decides whether a plan fits."""
    if not gpu:
        return limit
    return max(0.0, limit - runtime_bytes(communicators)) / (1 + FRAGMENTATION)
