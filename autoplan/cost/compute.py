"""Compute cost: a per-op roofline with achieved-efficiency constants.

For one traced op (an :class:`~autoplan.graph.OpNode`) running on 1/``shard`` of its work::

    t_fwd = max(F_fwd / (P * e_mm * g(M, N, K)), B_fwd / (W * e_mem)) + t_k   matmul / conv
    t_fwd = max(c F_fwd / R_attn(s, d), B_fwd / (W * e_mem)) + t_k             fused attention
    t_fwd = phi * (max(F_fwd / P_vec, B_fwd / (W * e_mem)) + t_k)     everything else

with g the GEMM shape factor of the shard (:mod:`autoplan.cost.kernel_shape`; the backward
gets the factor of its two GEMMs), R_attn the attention kernel's published rate for sequence
s and head dimension d (or P * e_attn), c = 1/2 for a causal kernel with a published rate
(it skips the masked half of the traced FLOPs) else 1, F the op's FLOPs, B the bytes it
reads and writes (scaled from the traced dtype to the compute dtype), P the device's dense tensor peak for the compute dtype, P_vec its float32
(vector) peak, W its memory bandwidth, t_k a fixed per-kernel cost and phi the fusion factor.
Under ``mixed-fp8`` a block's linear-layer GEMM takes P the float8 peak and a k-tile twice as
deep in elements, plus its float8 casts (:mod:`autoplan.cost.float8`).
Backward: F_bwd from the graph; B_bwd = B_fwd * F_bwd / F_fwd for matmuls (two GEMMs, each
moving about the forward's bytes) and B_bwd = B_fwd for memory-bound ops that get a
gradient (an element-wise backward reads the output gradient and what it saved and writes
the input gradient: 1.0x the forward traffic for add, mul, dropout, masked_fill and copies,
1.5x for GeLU, layer norm and softmax; ops on masks and indices get none). Views and other
metadata-only ops cost nothing; communication ops belong to :mod:`autoplan.cost.comm`.

Default efficiency constants per device family (:func:`default_efficiency`) -- a few global
numbers, never tuned per model:

* ``matmul`` -- the asymptotic fraction of the dense tensor peak a large, well-shaped GEMM
  keeps up in a long training run, times the shape factor of each GEMM
  (:func:`autoplan.cost.kernel_shape.gemm_factor`: wave quantisation over the device's SMs
  and the tile's software-pipeline fill against K, after NVIDIA's "Matrix
  Multiplication Background User's Guide"; the shape is one rank's shard after TP, at the
  micro-batch it runs at: :func:`gemm_dims`). The asymptote: the best GEMM shape reaches
  86.9% of peak on A100 SXM and 80.3% on H100 SXM (bf16 "maximum achievable matmul FLOPS",
  S. Bekman, ml-engineering, compute/accelerator, torch 2.6-2.7); under sustained load the
  GPU runs below the boost clock its peak assumes (NVIDIA quotes A100 HPL Rpeak at the
  1305 MHz sustainable at its power limit, not 1410 MHz: 0.93; G. Lockwood, "peak FLOPS");
  and inside a training step a GEMM shares the GPU with NCCL's kernels and the element-wise
  ones (L2, HBM and SM contention; NCCL's channels take ~10% of the SMs,
  :data:`autoplan.cost.overlap.INTERFERENCE`): 0.9, a modelled figure (the pre-issue-13
  factor, not separately measured). 0.869 x 0.93 x 0.9 = 0.727 ampere;
  0.803 x 0.93 x 0.9 = 0.672 hopper; volta as ampere (no MAMF figure; a mature,
  lower-clocked part). Before issue 13 the 0.9 stood for "a layer's shapes", and every GEMM
  got 0.70 (ampere) / 0.65 (hopper) whatever its shape; large shards now price within a few
  per cent of that and small ones (TP-8 shards of small layers, micro-batch 1) lower.
* ``attention`` -- fused (flash) attention kernels. Where FlashAttention-2 published forward
  + backward throughput by sequence length and head dimension (A100, H100: Dao 2023, arXiv
  2307.08691; :func:`autoplan.cost.kernel_shape.attention_tflops`) the rate is that figure
  (a kernel benchmarked alone) times the sustained-clock factor (``clock``) and the in-step
  factor the GEMMs get (``IN_STEP``: the kernel shares the GPU with NCCL's and the
  element-wise kernels), and times the device's tensor peak over the
  measured part's where it is lower (``FA2_REFERENCE_PEAK_TFLOPS``: a power-limited or NVL
  part of the family), on the FLOPs the kernel does (half the traced
  FLOPs under a causal mask, ``OpNode.causal``); the ``attention`` constant is the fallback
  for other devices and dtypes: ampere 0.50 (FA2, A100, 2k tokens, causal, head dim 128:
  155 of 312 TFLOP/s), hopper 0.28 (FlashAttention-3, Shah et al. 2024, arXiv 2407.08608,
  sec. 4.1: FA2 reaches ~35% of H100 peak forward, less backward), volta 0.40
  (memory-efficient kernels; FlashAttention-2 needs Ampere).
* ``sms``, ``clock``, ``attention_family`` -- the shape model's SM count
  (:data:`autoplan.cost.kernel_shape.SMS`), the sustained-clock factor and the key of the
  published attention table; CPU: none (sms 0: no shape factor).
* ``memory`` -- fraction of HBM bandwidth element-wise, normalisation and softmax kernels
  reach: stream-like copies reach ~85-90% on A100/H100 (BabelStream); kernels with
  reductions and broadcasting less: 0.80 on every GPU.
* ``fusion`` (phi) -- the fraction of the traced, unfused element-wise traffic and kernels
  that a training framework still runs. Megatron-LM fuses scale+mask+softmax, bias+GeLU and
  bias+dropout+add; counting bytes op by op over a GPT block's aten graph, these fusions keep
  0.42-0.58 of the element-wise traffic (lower without dropout, higher with it): phi = 0.5 on
  GPUs. On CPU autoplan's engine runs eager PyTorch with no fusion: phi = 1; so does a GPU
  run the user says is eager (``prepare(fused=False)``, ``--eager``: torchtitan without
  torch.compile, autoplan's own engine). A check on data phi was not set from: torchtitan's
  Llama 3.1 8B FSDP runs on 8 and 128 H100 measured torch.compile 1.157x and 1.162x faster
  than eager; phi 0.5 against 1 predicts 1.123x and 1.124x
  (``benchmarks/published_runs.py``, rows ``titan-8b-*``). The loss
  (``LOSS_OPS``: log-softmax and NLL over the vocabulary) is not in a block's fused chains:
  it runs as traced, phi = 1 (Megatron-LM's unfused vocab-parallel cross entropy runs max,
  subtract, exp, sum and log as separate passes, more than the traced two).
* ``kernel_overhead_s`` (t_k) -- launch and ramp/tail cost of one kernel on a busy stream,
  a few microseconds on NVIDIA GPUs (NCCL's tuning model and CUDA Graphs measurements put
  back-to-back launches at ~2-5 us): 3 us on GPUs; eager PyTorch dispatch on CPU: 10 us.

Calibration check (not a fit): the Megatron-LM SC'21 GPT runs of published.md, traced as
Megatron ran them (materialised attention with dropout 0.1, micro-batch 1, full
recomputation, TP all-reduces and the DP gradient all-reduce from :mod:`autoplan.cost.comm`),
come out 6-9% above the published 135-142 TFLOP/s per A100 with the shape factor
(``benchmarks/megatron_sc21.py``; 9-12% before it).
Traced with flash attention (``attention="sdpa"``, which SC'21 predates) they come out far
higher, as a 2021 A100 could not run that graph.

Widths. An op's bytes are priced at the width its tensors run at. A graph traced in float32
for a 16-bit run is rescaled to the compute width op by op; a graph traced at the compute
width (``OpGraph.dtype`` bfloat16 for a bf16 run) is priced as traced, so its explicit
float32 upcasts (the logits' ``.float()`` before the loss, an RMSNorm's float32 statistics)
cost float32 traffic. The loss always runs in float32 (torch autocast's float32 op list;
Megatron-LM's and torchtitan's ``logits.float()``): with a 128k vocabulary and 16k tokens
per micro-batch its logits are 8.6 GB in float32, read and written about six times a step
(upcast, log-softmax, its backward, the NLL's dense gradient) -- 5% of a 1.7B model's step on
an H100, which the earlier rule (every op at the compute width, then phi) priced at a quarter.

Measured timings replace the model op by op: ``ComputeModel(..., measured=fn)`` where
``fn(node, shard)`` returns (forward, backward) seconds or None to fall back to the roofline.
``measured_at=fn(node, graph, tp, batch_scale)`` does the same with the TP degree and the
micro-batch scale (micro-batch / traced batch) kept apart, so that a table keyed by shapes
can look the op up at the micro-batch it will run at (:mod:`autoplan.cost.profiled`);
:meth:`ComputeModel.op_time_at` asks it first, and :meth:`ComputeModel.layer_time` uses that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from autoplan.cluster import DeviceSpec, canonical_dtype
from autoplan.cost.float8 import cast_seconds, is_float8_gemm
from autoplan.cost.kernel_shape import (FA2_REFERENCE_PEAK_TFLOPS, GEMM_K0, SMS,
                                        attention_tflops, check_attention_kernel,
                                        gemm_backward_factor, gemm_factor)
from autoplan.graph import DTYPE_BYTES, Layer, OpGraph, OpNode
from autoplan.precision import check_float8_recipe

#: Bytes the optimizer step moves per parameter (mixed-precision Adam: read fp32 master,
#: m, v and a 2-byte gradient, write master, m, v and the 2-byte parameter copy = 28; fp32
#: Adam: read p, g, m, v, write p, m, v = 28).
ADAM_BYTES_PER_PARAM = 28.0

#: Bytes per local parameter of fp16 training's loss-scaling pass before the optimizer step:
#: the gradients (fp32 after the reduction, R = 4 bytes) are read once to check for inf/NaN
#: and unscaled in place, read and written (Micikevicius et al. 2018, "Mixed Precision
#: Training", sec. 3.2: dynamic loss scaling skips the step on overflow; PyTorch's
#: GradScaler.unscale_ and Megatron's multi_tensor_scale fuse the check and the unscale in
#: one pass: read 4 + write 4).
LOSS_SCALE_BYTES_PER_PARAM = 8.0

#: Backward bytes / forward bytes of a memory-bound op (module docstring).
BWD_MEMORY_RATIO = 1.0

VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "transpose", "t",
    "permute", "expand", "expand_as", "slice", "select", "unsqueeze", "squeeze", "alias",
    "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow", "as_strided",
    "unflatten", "flatten", "lift_fresh", "lift_fresh_copy", "movedim", "diagonal",
    "_to_copy_noop", "sym_size", "sym_stride", "sym_numel", "getitem", "output", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resolve_conj",
    "resolve_neg", "unsafe_split", "view_as_real", "view_as_complex",
})
MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution",
    "mkldnn_convolution", "convolution_overrideable", "_scaled_mm", "_int_mm", "einsum",
})
ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward", "_scaled_dot_product_fused_attention_overrideable",
    "flex_attention",
})
COMM_OPS = frozenset({
    "all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "wait_tensor", "broadcast", "broadcast_", "send", "recv",
    "allreduce_", "allgather_", "reduce_scatter_",
})
#: Fused kernels autoplan's trace records as one op (:mod:`autoplan.trace.ssm`): already
#: one kernel, so the fusion factor of unfused element-wise traffic does not apply.
FUSED_KERNEL_OPS = frozenset({"selective_scan", "selective_scan_backward", "wkv",
                              "wkv_backward"})
#: The loss: run in float32 under any mixed precision (torch autocast's float32 list;
#: Megatron-LM's and torchtitan's ``logits.float()``) and not fused away (module docstring).
LOSS_OPS = frozenset({
    "log_softmax", "_log_softmax", "nll_loss", "nll_loss_forward", "nll_loss_nd",
    "nll_loss2d_forward", "cross_entropy", "cross_entropy_loss",
})
_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "c10d_functional",
                         "torch", "ops", "_c10d_functional_autograd",
                         "autoplan"})          # the trace's fused kernels (trace/ssm.py)


def op_base_name(op: str) -> str:
    """'aten.mm.default' / 'aten::mm' / 'torch.ops.aten.mm.default' / 'mm' -> 'mm'."""
    parts = [p for p in op.replace("::", ".").split(".") if p]
    while len(parts) > 1 and parts[0] in _NAMESPACES:
        parts = parts[1:]
    return parts[0] if parts else op


def op_kind(node: OpNode) -> str:
    """'view', 'comm', 'matmul', 'attention' or 'memory' (module docstring)."""
    base = op_base_name(node.op)
    if base in VIEW_OPS:
        return "view"
    if base in COMM_OPS:
        return "comm"
    if base in ATTENTION_OPS:
        return "attention"
    if base in MATMUL_OPS:
        return "matmul"
    return "memory"


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achieved fractions of peak and the fusion / kernel-overhead constants.

    ``matmul``: of the dense tensor peak, for GEMM/conv ops. ``memory``: of memory
    bandwidth, for everything else. ``attention``: of the tensor peak, for fused attention
    kernels (None: use ``matmul``). ``fusion``: fraction of the unfused element-wise traffic
    and kernels that remains after the framework's fusions (1 = none). ``kernel_overhead_s``:
    fixed seconds per kernel. See the module docstring for the defaults and their sources.
    """

    matmul: float
    memory: float
    attention: float | None = None
    fusion: float = 1.0
    kernel_overhead_s: float = 0.0
    sms: int = 0                   # streaming multiprocessors of the GEMM shape model (0: off)
    attention_family: str = ""     # key of the published attention table ("": none)
    clock: float = 1.0             # sustained / boost clock, applied to published kernel rates

    def __post_init__(self) -> None:
        for name in ("matmul", "memory", "attention", "fusion"):
            value = getattr(self, name)
            if value is None and name == "attention":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {value!r}")
        if isinstance(self.sms, bool) or not isinstance(self.sms, int) or self.sms < 0:
            raise ValueError(f"Efficiency.sms must be an integer >= 0, got {self.sms!r}")
        if not isinstance(self.clock, (int, float)) or not 0 < self.clock <= 1:
            raise ValueError(f"Efficiency.clock must be in (0, 1], got {self.clock!r}")
        if not isinstance(self.kernel_overhead_s, (int, float)) or self.kernel_overhead_s < 0:
            raise ValueError(f"Efficiency.kernel_overhead_s must be >= 0, "
                             f"got {self.kernel_overhead_s!r}")

    @property
    def attention_or_matmul(self) -> float:
        return self.matmul if self.attention is None else self.attention


#: Sustained / boost clock under a training load (module docstring: A100 HPL Rpeak).
SUSTAINED_CLOCK = 0.93
#: A GEMM inside a training step against the same GEMM alone (module docstring).
IN_STEP = 0.9
#: Best-shape GEMM fraction of peak (MAMF, module docstring) x the sustained clock x IN_STEP:
#: the asymptote the shape factor multiplies.
_MM = {family: round(mamf * SUSTAINED_CLOCK * IN_STEP, 3)
       for family, mamf in (("ampere", 0.869), ("hopper", 0.803), ("volta", 0.869))}
_GPU_GENERIC = Efficiency(matmul=0.65, memory=0.80, attention=0.40, fusion=0.5,
                          kernel_overhead_s=3e-6)
#: Default efficiency per DeviceSpec.family (module docstring has the sources).
DEFAULT_EFFICIENCY: Mapping[str, Efficiency] = MappingProxyType({
    "ampere": Efficiency(matmul=_MM["ampere"], memory=0.80, attention=0.50, fusion=0.5,
                         kernel_overhead_s=3e-6, sms=SMS["ampere"],
                         attention_family="ampere", clock=SUSTAINED_CLOCK),
    "hopper": Efficiency(matmul=_MM["hopper"], memory=0.80, attention=0.28, fusion=0.5,
                         kernel_overhead_s=3e-6, sms=SMS["hopper"],
                         attention_family="hopper", clock=SUSTAINED_CLOCK),
    "volta": Efficiency(matmul=_MM["volta"], memory=0.80, attention=0.40, fusion=0.5,
                        kernel_overhead_s=3e-6, sms=SMS["volta"], clock=SUSTAINED_CLOCK),
    "gpu": _GPU_GENERIC,
    # CPU (quick check on cpu-local: fp32 2048^3 matmul ~55% of the estimated peak; copy
    # ~64 GB/s of the ~60-80 GB/s estimate); eager PyTorch: no fusion, ~10 us per op.
    "cpu": Efficiency(matmul=0.55, memory=0.75, attention=0.30, fusion=1.0,
                      kernel_overhead_s=10e-6),
})


def default_efficiency(device: DeviceSpec) -> Efficiency:
    """The documented defaults for ``device.family`` (generic GPU figures if unknown)."""
    return DEFAULT_EFFICIENCY.get(device.family, _GPU_GENERIC)


MeasuredFn = Callable[[OpNode, float], "tuple[float, float] | None"]
MeasuredAtFn = Callable[[OpNode, OpGraph, int, float], "tuple[float, float] | None"]


_BATCHED_GEMMS = frozenset({"bmm", "baddbmm"})


def gemm_dims(node: OpNode, tp: float = 1.0,
              batch_scale: float = 1.0) -> tuple[float, float, float, float] | None:
    """(batch, M, N, K) of one rank's share of a GEMM-like op (None if the shapes say
    nothing): N the output's last dimension (a convolution's: its channels), M the rest
    (``bmm``: the first dimension is the batch), K = FLOPs / (2 batch M N). ``tp`` splits N for a column-parallel op, K for a
    row-parallel one, the batch (heads) of a ``sharded`` bmm and M otherwise; ``batch_scale``
    scales M (a bmm's batch)."""
    out = node.output_meta[0].shape if node.output_meta else ()
    if len(out) < 1 or node.fwd_flops <= 0:
        return None
    base = op_base_name(node.op)
    # a convolution is a GEMM with N = output channels (dim 1), M = batch x spatial
    n = float(out[1] if "conv" in base and len(out) >= 3 else out[-1])
    numel = float(math.prod(out))
    batch = float(out[0]) if base in _BATCHED_GEMMS and len(out) == 3 else 1.0
    m = numel / (batch * n) if n > 0 else 0.0
    if m <= 0 or n <= 0:
        return None
    k = node.fwd_flops / (2.0 * batch * m * n)
    role = node.tp_role
    heads = batch > 1 and role == "sharded"      # a bmm split along its batch (heads)
    if role == "column":
        n /= tp
    elif role == "row":
        k /= tp
    elif not heads:
        m /= tp
    if batch > 1:
        # one rank's batch is batch x batch_scale / tp whichever way the split is written
        # (the grid passes the micro-batch as batch_scale, the search may fold the
        # data-parallel split into tp); a fraction of one batch entry shortens M
        batch *= batch_scale / tp if heads else batch_scale
        if batch < 1:
            m *= batch
            batch = 1.0
    else:
        m *= batch_scale
    return batch, m, n, k


class ComputeModel:
    """Forward/backward seconds of ops and layers on one device (module docstring).

    ``dtype`` is the compute dtype (mixed precision: 'bfloat16'); the graph may have been
    traced in another dtype, and each op's bytes are rescaled to ``dtype``'s width.
    ``matmul_dtype`` 'float8' runs the blocks' linear layers on float8 tensor cores, with
    their casts (``mixed-fp8``, :mod:`autoplan.cost.float8`); None: every GEMM in ``dtype``.
    ``float8_recipe`` says whose casts: torchao's (autoplan's engine) or Transformer Engine's;
    ``attention_kernel`` which fused attention runs (FlashAttention-2 or cuDNN's,
    :mod:`autoplan.cost.kernel_shape`).
    """

    def __init__(self, device: DeviceSpec, dtype: str = "bfloat16",
                 efficiency: Efficiency | None = None, *,
                 measured: MeasuredFn | None = None,
                 measured_at: MeasuredAtFn | None = None,
                 matmul_dtype: str | None = None, float8_recipe: str = "torchao",
                 attention_kernel: str = "flash2"):
        self.device = device
        self.dtype = canonical_dtype(dtype)
        self.peak = device.peak_flops(self.dtype)          # raises if the device lacks it
        self.matmul_dtype = canonical_dtype(matmul_dtype) if matmul_dtype else None
        if self.matmul_dtype not in (None, "float8"):
            raise ValueError(f"matmul_dtype must be None or 'float8', got {matmul_dtype!r}")
        self.float8_recipe = check_float8_recipe(float8_recipe)
        self.attention_kernel = check_attention_kernel(attention_kernel)
        # float8 GEMMs: the float8 peak, or the compute dtype's where the device has none
        self.float8_peak = device.peak_flops("float8") if self.matmul_dtype \
            and "float8" in device.peak_tflops else self.peak
        self.vector_peak = device.peak_flops("float32") if "float32" in device.peak_tflops \
            else self.peak
        self.efficiency = efficiency or default_efficiency(device)
        self.measured = measured
        self.measured_at = measured_at
        storage = {"tf32": "float32", "float8": "float8_e4m3fn"}.get(self.dtype, self.dtype)
        self._dtype_bytes = DTYPE_BYTES.get(storage, 4)
        self._cache: dict[tuple, tuple[float, float]] = {}

    # ---- one op --------------------------------------------------------------------------
    def _byte_scale(self, node: OpNode, traced_dtype: str | None, loss: bool) -> float:
        """Width the op's float tensors run at / their traced width (module docstring,
        "Widths"): float32 for a ``loss`` op; 1 where the graph was traced at the compute
        width (``traced_dtype``, the graph's parameter dtype: its float32 tensors are explicit
        upcasts that run in float32); else compute width / traced width; 1 without floats."""
        for meta in (*node.output_meta, *node.input_meta):
            if _is_float(meta.dtype):
                width = DTYPE_BYTES.get(meta.dtype, 4)
                if loss:
                    return 4.0 / width
                if traced_dtype is not None and DTYPE_BYTES.get(traced_dtype) == self._dtype_bytes:
                    return 1.0
                return self._dtype_bytes / width
        return 1.0

    @staticmethod
    def _has_backward(node: OpNode) -> bool:
        """An op whose inputs and outputs are not both floating point gets no gradient
        (masks, index computations, factory ops like ones/arange/tril of bools)."""
        return (any(_is_float(m.dtype) for m in node.output_meta)
                and any(_is_float(m.dtype) for m in node.input_meta))

    def op_time(self, node: OpNode, shard: float = 1.0,
                traced_dtype: str | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of ``node`` doing 1/``shard`` of its work (a GEMM's
        shape shrinks along the dimension its ``tp_role`` splits; ``shard`` < 1 is a larger
        batch); ``traced_dtype``: the parameter dtype its graph was traced in
        (:meth:`_byte_scale`)."""
        if shard <= 0:
            raise ValueError(f"shard must be > 0, got {shard}")
        return self._op_time(node, shard, 1.0, traced_dtype) if shard >= 1 else \
            self._op_time(node, 1, 1.0 / shard, traced_dtype)

    def _op_time(self, node: OpNode, tp: float, batch_scale: float,
                 traced_dtype: str | None = None, float8: bool = False) -> tuple[float, float]:
        kind = op_kind(node)
        if kind in ("view", "comm"):
            return 0.0, 0.0
        shard = tp / batch_scale
        if self.measured is not None:
            hit = self.measured(node, shard)
            if hit is not None:
                return float(hit[0]), float(hit[1])
        eff = self.efficiency
        bw = self.device.memory_bandwidth * eff.memory
        t_k = eff.kernel_overhead_s
        loss = op_base_name(node.op) in LOSS_OPS
        nbytes = (node.bytes_read + node.bytes_written) \
            * self._byte_scale(node, traced_dtype, loss) / shard
        f_fwd, f_bwd = node.fwd_flops / shard, node.bwd_flops / shard
        casts = (0.0, 0.0)
        if kind == "matmul":
            dims = gemm_dims(node, tp, batch_scale)
            # a float8 GEMM: the float8 peak, and a k-tile of the same bytes holds twice the
            # elements; plus its casts (autoplan.cost.float8)
            peak, k0 = (self.float8_peak, 2 * GEMM_K0) if float8 else (self.peak, GEMM_K0)
            rate = peak * eff.matmul
            r_fwd = rate * (gemm_factor(*dims, eff.sms, k0) if dims else 1.0)
            r_bwd = rate * (gemm_backward_factor(*dims, eff.sms, k0) if dims else 1.0)
            kernels = 2                                    # dgrad + wgrad
            if float8 and dims is not None:
                casts = cast_seconds(dims, width=self._dtype_bytes, bandwidth=bw,
                                     kernel_s=t_k, phi=eff.fusion,
                                     recipe=self.float8_recipe)
        elif kind == "attention":
            r_fwd, done = self._attention_rate(node)
            r_bwd = r_fwd
            f_fwd, f_bwd = f_fwd * done, f_bwd * done
            kernels = 1                                    # one fused backward kernel
        if kind in ("matmul", "attention"):
            fwd = max(f_fwd / r_fwd, nbytes / bw) + t_k if r_fwd > 0 else nbytes / bw + t_k
            if f_bwd <= 0:
                return fwd + casts[0], 0.0
            b_bwd = nbytes * (f_bwd / f_fwd if f_fwd > 0 else 2.0)
            return (fwd + casts[0],
                    max(f_bwd / r_bwd, b_bwd / bw) + kernels * t_k + casts[1])
        phi = 1.0 if loss or op_base_name(node.op) in FUSED_KERNEL_OPS else eff.fusion
        fwd = phi * (max(f_fwd / self.vector_peak, nbytes / bw) + t_k)
        if not self._has_backward(node):
            return fwd, 0.0
        bwd = phi * (max(f_bwd / self.vector_peak, BWD_MEMORY_RATIO * nbytes / bw) + t_k)
        return fwd, bwd

    def _attention_rate(self, node: OpNode) -> tuple[float, float]:
        """(FLOP/s, fraction of the traced FLOPs it applies to) of a fused attention op:
        the published rate of :attr:`attention_kernel` for its sequence and head dimension
        where the device family has one, on the FLOPs the kernel does (half under a causal mask), else
        ``peak * attention`` on the traced FLOPs (module docstring)."""
        eff = self.efficiency
        q = node.input_meta[0].shape if node.input_meta else ()
        if eff.attention_family and len(q) >= 2 and self.dtype in ("bfloat16", "float16"):
            causal = bool(getattr(node, "causal", False))
            tflops = attention_tflops(eff.attention_family, q[-2], q[-1], causal,
                                      self.attention_kernel)
            if tflops is not None:
                ref = FA2_REFERENCE_PEAK_TFLOPS.get(eff.attention_family)
                part = min(1.0, self.peak / (ref * 1e12)) if ref else 1.0
                rate = tflops * 1e12 * eff.clock * IN_STEP * part
                return min(rate, self.peak), 0.5 if causal else 1.0
        return self.peak * eff.attention_or_matmul, 1.0

    def op_time_at(self, node: OpNode, graph: OpGraph, tp: int = 1,
                   batch_scale: float = 1.0) -> tuple[float, float]:
        """(forward, backward) seconds of ``node`` on one rank of a TP group of ``tp`` that
        splits it, at ``batch_scale`` x the traced micro-batch: ``measured_at`` if it has the
        op, else the model with the GEMM's shape sharded as ``node.tp_role`` says."""
        float8 = self.matmul_dtype == "float8" and is_float8_gemm(node, graph)
        if self.measured_at is not None and op_kind(node) not in ("view", "comm") \
                and not float8:
            hit = self.measured_at(node, graph, tp, batch_scale)
            if hit is not None:
                return float(hit[0]), float(hit[1])
        return self._op_time(node, tp, batch_scale, getattr(graph, "dtype", None), float8)

    # ---- one layer -----------------------------------------------------------------------
    def layer_time(self, layer: Layer, graph: OpGraph, *, tp: int = 1,
                   sequence_parallel: bool = False,
                   micro_batch_scale: float = 1.0) -> tuple[float, float]:
        """(forward, backward) seconds of ``layer`` on one device of a TP group of ``tp``.

        ``column``/``row``/``sharded`` ops do 1/tp of their work; ``replicated`` ops only
        under sequence parallelism. ``micro_batch_scale`` = micro-batch / traced batch: it
        scales FLOPs and bytes (not the per-kernel overhead), so pass it rather than
        multiplying the result. Tensor-parallel communication is not included (see
        :mod:`autoplan.cost.comm` and ``LayerStats.tp_allreduce_*_bytes``).
        """
        if tp < 1 or micro_batch_scale <= 0:
            raise ValueError(f"need tp >= 1 and micro_batch_scale > 0, got {tp}, "
                             f"{micro_batch_scale}")
        key = (graph.fingerprint, graph.batch.batch_size, layer.index if not layer.kind
               else layer.kind, tp, sequence_parallel, micro_batch_scale)
        if self.measured is None and key in self._cache:
            return self._cache[key]
        fwd = bwd = 0.0
        for name in layer.nodes:
            node = graph.nodes[name]
            sharded = node.tp_role != "replicated" or sequence_parallel
            f, b = self.op_time_at(node, graph, tp if sharded else 1, micro_batch_scale)
            fwd += f
            bwd += b
        self._cache[key] = (fwd, bwd)
        return fwd, bwd

    # ---- optimizer -----------------------------------------------------------------------
    def optimizer_time(self, num_params: float,
                       bytes_per_param: float = ADAM_BYTES_PER_PARAM) -> float:
        """Seconds of an Adam step over ``num_params`` local parameters (memory-bound); in
        fp16 compute with the loss-scaling pass over the gradients before it
        (:data:`LOSS_SCALE_BYTES_PER_PARAM`)."""
        if self.dtype == "float16":
            bytes_per_param = bytes_per_param + LOSS_SCALE_BYTES_PER_PARAM
        return num_params * bytes_per_param / (self.device.memory_bandwidth
                                               * self.efficiency.memory)
