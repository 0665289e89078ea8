"""How the shape of one GEMM or attention kernel sets the fraction of the peak it reaches.

Torch-free; pure functions over sizes. :mod:`autoplan.cost.compute` multiplies a device's
asymptotic efficiency by these factors.

**GEMM** (``C[M, N] = A[M, K] B[K, N]``, ``batch`` independent products). cuBLAS splits C
into output tiles, one thread block each, and picks the tile per shape from a list running
from 256x128 / 128x256 (most efficient per SM on large problems) through 128x128 to 64x64
(NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, sec. 2.3); for the
mid-sized shapes where the choice matters it trades tile efficiency for more tiles, so the
model counts tiles of the middle of that list, 128x128. Two losses follow from the shape
(same guide, ch. 3):

* *wave quantisation* (sec. 3.2): T = batch·M·N / (128·128) tiles run in waves of S tiles
  (S = streaming multiprocessors); the last wave is partly empty. With the last wave on
  average half full, T tiles take T/S + 1/2 waves' time for T/S waves' work::

      u_wave(T) = T / (T + S/2)

  (smooth and monotone where the exact ceil(T/S) saw-tooth is neither; T << S gives ~2T/S,
  within a factor 2 of the fraction of SMs with a tile; large T gives 1);
* *depth*: a tile's main loop runs K/k_tile steps, and the multi-stage software pipeline
  is filled before its first MMA without overlapping any math: stages - 1 = 2 k-tiles of
  64 in CUTLASS's 3-stage sm80 mainloop (``default_gemm_configuration``, 3 stages, k-tile
  64), so K0 = 128 and ``u_depth(K) = K / (K + K0)``. (The epilogue of one tile overlaps
  the main loop of the other tile resident on the SM.) Small K is memory-bound as well; the
  roofline's bytes term in :mod:`autoplan.cost.compute` prices that separately.

So ``factor = u_wave(batch·M·N) · u_depth(K)``; the backward's two GEMMs (data gradient
``[M, K] = dC[M, N] B^T``, contraction N; weight gradient ``[K, N] = A^T dC``, contraction M)
get their own factors. Tile quantisation (sec. 3.1, M or N not a multiple of the tile) is left
out: transformer dimensions are multiples of 128.

**Attention** (FlashAttention-2, Dao 2023, arXiv 2307.08691, sec. 4.1, the forward +
backward benchmark figures for A100 80GB SXM4 and H100 80GB SXM5, published as
``assets/flash2_a100_fwd_bwd_benchmark.png`` and ``assets/flash2_h100_fwd_bwd_benchmark.png``
in Dao-AILab/flash-attention; two A100 bars whose labels the legend hides, non-causal
head dim 64 at 1k and head dim 128 at 512, are read from the bar heights): forward +
backward TFLOP/s of FlashAttention-2 by sequence length (512 .. 16k; batch·seq = 16k tokens,
hidden 2048) and head dimension (64, 128), with and without the causal mask. That benchmark
counts FLOPs as 4·b·h·s²·d forward, 2.5x that backward, *halved* under the causal mask
(``benchmarks/benchmark_flash_attention.py``, ``flops()``); autoplan's traced FLOPs
(``torch.utils.flop_counter``) are the same formula without the halving, so a causal kernel
does half the traced FLOPs: :func:`attention_tflops` returns the rate on the FLOPs the kernel
does, and :mod:`autoplan.cost.compute` halves the FLOPs of a causal op. Sequence lengths
between the table's points interpolate in log2(s); outside it, the end value; head dimensions
between 64 and 128 interpolate linearly, outside them the nearest.

**Which attention kernel** (:data:`ATTENTION_KERNELS`, a pricing assumption about the
runtime like the float8 recipe; the plan does not record it): ``flash2``, the table above
(torch's SDPA flash backend: autoplan's engine, torchtitan, MosaicML's flash-attn), or
``cudnn``, cuDNN's fused attention, which NVIDIA Transformer Engine runs on Hopper
(Megatron-Core, NeMo). Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608) Fig. 5 and 6
measured both on one H100 80GB SXM5 in FlashAttention-2's benchmark (bf16, batch·seq = 16k,
hidden 2048, no mask), forward and backward separately, head dims 64 and 128
(:data:`FA3_PAPER_TFLOPS`). A cuDNN op is priced at FlashAttention-2's rate for its shape
times cuDNN's speedup over FlashAttention-2 in that figure at the same sequence length and
head dimension, forward + backward combined on FlashAttention's FLOP count (backward 2.5x
the forward): ``r = 3.5 / (1 / r_fwd + 2.5 / r_bwd)`` (:func:`cudnn_speedup`: 1.31-1.44x at
head dim 64, 1.46-1.63x at 128). The causal panels' backward is not published; their
forward speedups (Fig. 5, 1.58-1.65x at 128) match the unmasked ones', so the unmasked
speedup is used for both. Other families have no published cuDNN figure and keep
FlashAttention-2's rate.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping

from autoplan.errors import one_of
from autoplan.pricing import ATTENTION_KERNELS    # the names a plan's pricing records

#: Elements of the output tile the model counts (128 x 128; module docstring).
TILE_ELEMENTS = 128 * 128
#: K-extent of a tile's unoverlapped pipeline fill (module docstring).
GEMM_K0 = 128.0

#: Streaming multiprocessors per device family (NVIDIA architecture whitepapers: A100 108,
#: H100 SXM5 132 (H200 the same die), V100 80). The family stands for the SXM part.
SMS: Mapping[str, int] = MappingProxyType({"ampere": 108, "hopper": 132, "volta": 80})

_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
#: Dense bf16 tensor peak (TFLOP/s) of the part each family's table was measured on (A100 80GB
#: SXM4, H100 80GB SXM5): a part of the same family with a lower peak (a lower clock or power
#: limit: H100 NVL, a 500 W H100) runs the kernel that much slower.
FA2_REFERENCE_PEAK_TFLOPS: Mapping[str, float] = MappingProxyType({"ampere": 312.0,
                                                                   "hopper": 989.0})
#: FlashAttention-2 forward + backward TFLOP/s, read off Dao 2023 Fig. 4 / 5-6 (module
#: docstring): {family: {(head_dim, causal): TFLOP/s at _SEQS}}.
FA2_FWD_BWD_TFLOPS: Mapping[str, Mapping[tuple[int, bool], tuple[float, ...]]] = \
    MappingProxyType({
        "ampere": MappingProxyType({
            (64, False): (132, 153, 162, 171, 175, 176),
            (128, False): (151, 173, 187, 196, 201, 203),
            (64, True): (88, 119, 140, 156, 165, 171),
            (128, True): (99, 133, 155, 173, 182, 189),
        }),
        "hopper": MappingProxyType({
            (64, False): (215, 254, 274, 288, 294, 296),
            (128, False): (248, 294, 320, 326, 335, 338),
            (64, True): (141, 192, 232, 257, 273, 284),
            (128, True): (163, 221, 265, 294, 308, 328),
        }),
    })


#: Shah et al. 2024, Fig. 5 (forward) and Fig. 6 (backward), H100 80GB SXM5, bf16, no mask:
#: TFLOP/s at _SEQS, {(head_dim, kernel): (forward, backward)} (module docstring).
FA3_PAPER_TFLOPS: Mapping[tuple[int, str], tuple[tuple[float, ...], tuple[float, ...]]] = \
    MappingProxyType({
        (64, "flash2"): ((282, 306, 318, 321, 322, 324), (198, 238, 264, 279, 287, 291)),
        (64, "cudnn"): ((335, 373, 395, 408, 412, 413), (266, 348, 395, 417, 432, 433)),
        (128, "flash2"): ((309, 350, 362, 368, 370, 370), (214, 260, 291, 310, 318, 322)),
        (128, "cudnn"): ((497, 574, 617, 609, 600, 595), (305, 408, 465, 499, 518, 516)),
    })


def check_attention_kernel(kernel: object) -> str:
    """``kernel`` if it is one of :data:`ATTENTION_KERNELS`; ValueError otherwise."""
    return one_of(kernel, ATTENTION_KERNELS, "attention kernel")


def _fwd_bwd(fwd: float, bwd: float) -> float:
    """Forward + backward TFLOP/s on FlashAttention's count (backward 2.5x the forward)."""
    return 3.5 / (1.0 / fwd + 2.5 / bwd)


def cudnn_speedup(seq: float, head_dim: float) -> float:
    """cuDNN's forward + backward rate over FlashAttention-2's on an H100 (module
    docstring), interpolated as :func:`attention_tflops` interpolates."""
    def at(hd: int) -> float:
        rates = {k: _fwd_bwd(_interp_seq(FA3_PAPER_TFLOPS[(hd, k)][0], seq),
                             _interp_seq(FA3_PAPER_TFLOPS[(hd, k)][1], seq))
                 for k in ATTENTION_KERNELS}
        return rates["cudnn"] / rates["flash2"]
    w = min(max((head_dim - 64) / 64, 0.0), 1.0)
    return at(64) + w * (at(128) - at(64))


def wave_utilisation(tiles: float, sms: int) -> float:
    """u_wave(T) = T / (T + S/2) (module docstring); 1 when ``sms`` is 0 (no model)."""
    if sms <= 0:
        return 1.0
    if tiles <= 0:
        return 0.0
    return tiles / (tiles + sms / 2)


def depth_utilisation(k: float, k0: float = GEMM_K0) -> float:
    """u_depth(K) = K / (K + K0) (module docstring)."""
    return k / (k + k0) if k > 0 else 0.0


def gemm_factor(batch: float, m: float, n: float, k: float, sms: int,
                k0: float = GEMM_K0) -> float:
    """Fraction of the asymptotic GEMM efficiency a [batch x M x N x K] product reaches."""
    if sms <= 0:
        return 1.0
    return wave_utilisation(batch * m * n / TILE_ELEMENTS, sms) * depth_utilisation(k, k0)


def gemm_backward_factor(batch: float, m: float, n: float, k: float, sms: int,
                         k0: float = GEMM_K0) -> float:
    """The backward's factor: its two equal-FLOP GEMMs (data gradient [M, K] contracting N,
    weight gradient [K, N] contracting M) take 1/f_dgrad + 1/f_wgrad halves, so the factor
    is their harmonic mean."""
    if sms <= 0:
        return 1.0
    f_d = gemm_factor(batch, m, k, n, sms, k0)
    f_w = gemm_factor(batch, k, n, m, sms, k0)
    if f_d <= 0 or f_w <= 0:
        return 0.0
    return 2.0 / (1.0 / f_d + 1.0 / f_w)


def _interp_seq(values: tuple[float, ...], seq: float) -> float:
    if seq <= _SEQS[0]:
        return values[0]
    if seq >= _SEQS[-1]:
        return values[-1]
    x = math.log2(seq)
    for i in range(len(_SEQS) - 1):
        lo, hi = math.log2(_SEQS[i]), math.log2(_SEQS[i + 1])
        if x <= hi:
            w = (x - lo) / (hi - lo)
            return values[i] + w * (values[i + 1] - values[i])
    return values[-1]


def attention_tflops(family: str, seq: float, head_dim: float, causal: bool,
                     kernel: str = "flash2") -> float | None:
    """Forward + backward TFLOP/s of ``kernel`` (:data:`ATTENTION_KERNELS`) on the FLOPs it
    does (module docstring), or None for a family without published figures."""
    table = FA2_FWD_BWD_TFLOPS.get(family)
    if table is None:
        return None
    r64 = _interp_seq(table[(64, causal)], seq)
    r128 = _interp_seq(table[(128, causal)], seq)
    w = min(max((head_dim - 64) / 64, 0.0), 1.0)
    rate = r64 + w * (r128 - r64)
    if kernel == "cudnn" and family == "hopper":      # checked once, by ComputeModel
        rate *= cudnn_speedup(seq, head_dim)
    return rate
