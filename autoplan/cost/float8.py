"""Float8 GEMMs of ``mixed-fp8`` (:mod:`autoplan.precision`): which ops, and the casts they add.

Which ops: the GEMM of a linear layer (an op whose ``module_type`` is ``Linear`` and that
reads a weight) that :func:`autoplan.precision.float8_layer` admits -- in a transformer
block, weight dimensions multiples of 16. Attention's products, the embedding and the
output projection stay in bfloat16.

The GEMM runs on the float8 tensor cores: the device's dense float8 peak (H100 SXM 1,979
TFLOP/s, twice bf16) times the same asymptotic fraction and shape factor as a bf16 GEMM
(:mod:`autoplan.cost.compute`). The asymptote is bf16's: cuBLASLt float8 GEMMs of 8192^3
measured 1,599-1,630 TFLOP/s on the sixteen Hopper GPUs of one published cluster check
("cuBLASLt FP8 GEMM Cross-Check Report", 2026; 0.81 of H100 SXM's 1,979), bf16's best shape
0.803 (MAMF): the same fraction within the spread. The tile's K-depth
holds the same bytes, so twice the elements: the pipeline fill is ``2 x GEMM_K0`` elements
of K (:func:`autoplan.cost.kernel_shape.depth_utilisation`). Where a device has no float8
peak (a CPU: torch's ``_scaled_mm`` there computes in a wider type) the GEMM is priced at
the compute dtype's rate.

The casts (torchao ``Float8Linear``, tensorwise dynamic scaling, at torchao 0.18
``float8_linear.py``): the forward casts the input X [M, K] and the weight W [K, N]; the
backward casts the output gradient dY [M, N] twice (one layout per backward GEMM) and X and
W again (the forward saves them in the compute dtype, so activation memory is that of
``mixed``). Each cast is an amax reduction (reads the tensor) and a scaled cast (reads it,
writes one byte per element): ``2 w + 1`` bytes per element at compute width w, two kernels::

    t_cast_fwd = phi ((2w + 1) (X + W) / (W_hbm e_mem) + 4 t_k)
    t_cast_bwd = phi ((2w + 1) (2 dY + X + W) / (W_hbm e_mem) + 8 t_k)

phi the element-wise fusion factor (torch.compile fuses the amax into the producer and the
two layouts' casts; eager runs them as written).

**Transformer Engine** (``float8_recipe="transformer-engine"``: Megatron-LM and NeMo, which
an exported Megatron-LM plan runs; TE's ``LayerNormLinear`` / ``LayerNormMLP`` and its
``cast_transpose`` kernels, delayed scaling) moves fewer bytes for the same GEMMs: the kernel
that produces a GEMM's input (the norm, the activation) writes it in float8 together with
its transpose, one byte each, with the amax taken on the way (no separate pass); the float8
weight and its transpose are cast once per optimizer step and cached across the step's
micro-batches (``is_first_microbatch``), a cost not charged per micro-batch here; the saved
float8 input and weight transposes serve the backward GEMMs, so only the output gradient is
cast there, by one fused cast-transpose kernel (read w bytes, write two float8 layouts)::

    t_cast_fwd = 2 X / (W_hbm e_mem)
    t_cast_bwd = (w + 2) dY / (W_hbm e_mem) + t_k

(no phi: these are TE's own fused kernels). Checked on NVIDIA's NeMo 24.12 float8 table
(``benchmarks/published_runs.py``, source ``nemo-h100-fp8``; nothing fitted on it): its
held-out median error is 9% with these casts, 16% with torchao's.

Not modelled: float8 all-gathers of FSDP
(torchtitan's ``enable_fsdp_float8_all_gather``, off by default; weights are gathered in
bf16 here; the engine gathers them so), torchtitan's float8 tensor-parallel styles (its
all-gathers before column-parallel GEMMs move float8; the engine's plain styles move bf16, as
priced), eager torchao's extra small ops per cast on a CPU (a CPU run emulates float8: its
prediction prices the casts as two kernels each and is optimistic there) and delayed
scaling (Transformer Engine's amax history: the amax pass is folded into the previous step,
one fewer read).
"""

from __future__ import annotations

from autoplan.graph import OpGraph, OpNode
from autoplan.precision import check_float8_recipe, float8_layer

#: Kernels per cast (amax reduction, scaled cast).
CAST_KERNELS = 2


def is_float8_gemm(node: OpNode, graph: OpGraph) -> bool:
    """Whether ``mixed-fp8`` runs ``node`` on float8 tensor cores (module docstring)."""
    if node.module_type != "Linear" or not 0 <= node.layer < len(graph.layers):
        return False
    weights = [graph.params[p] for p in node.params
               if p in graph.params and len(graph.params[p].shape) == 2]
    return len(weights) == 1 and float8_layer(graph.layers[node.layer].name,
                                              tuple(weights[0].shape))


def cast_seconds(dims: tuple[float, float, float, float], *, width: float, bandwidth: float,
                 kernel_s: float, phi: float, recipe: str = "torchao") -> tuple[float, float]:
    """(forward, backward) seconds of one float8 linear's casts on one rank under ``recipe``
    (one of :data:`autoplan.precision.FLOAT8_RECIPES`; module docstring); ``dims`` its
    (batch, M, N, K) share, ``bandwidth`` the achieved HBM bytes/s."""
    batch, m, n, k = dims
    x, w, dy = batch * m * k, k * n, batch * m * n
    if check_float8_recipe(recipe) == "transformer-engine":
        return 2.0 * x / bandwidth, (width + 2.0) * dy / bandwidth + kernel_s
    per_elem = 2.0 * width + 1.0
    fwd = phi * (per_elem * (x + w) / bandwidth + 2 * CAST_KERNELS * kernel_s)
    bwd = phi * (per_elem * (2 * dy + x + w) / bandwidth + 4 * CAST_KERNELS * kernel_s)
    return fwd, bwd
