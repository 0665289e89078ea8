"""Tensor-parallel communication overlapped with the GEMMs around it (a plan's
``parallel.tp_comm_overlap``).

Under tensor + sequence parallelism every transformer layer all-gathers the sequence-sharded
input of its column-parallel GEMMs (QKV, FC1) and reduce-scatters the output of its
row-parallel GEMMs (attention projection, FC2) -- and their duals in backward (Korthikanti
et al. 2022, sec. 4.2.2). Plainly each collective waits for (or is waited on by) its GEMM,
so the step pays all of it (:mod:`autoplan.planner.grid.estimate`). Megatron-LM's
``--tp-comm-overlap`` (Transformer Engine userbuffers) and torchtitan's async tensor
parallelism (``enable_async_tensor_parallel``: torch's micro-pipelined
``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` over symmetric memory)
decompose each collective and its dependent GEMM into n steps so that step i's transfer runs
beside step i-1's GEMM (Wang et al. 2023, "Overlap Communication with Dependent Computation
via Decomposition in Large Deep Learning Models", ASPLOS'23, sec. 3: the looped collective
einsum, n = the TP degree for a ring of point-to-point transfers).

**Price.** With C the layer's TP collectives (seconds, one direction), W the compute of the
TP-sharded GEMMs they feed or drain (:func:`tp_gemm_nodes`) and n = t steps::

    paid(C, W, n) = C - h + INTERFERENCE h
    h             = min(EFFICIENCY C (n - 1) / n, W)        the hidden part

One step of the transfer has nothing to hide behind (the first chunk of an all-gather is
needed before any GEMM, the last partial sum of a reduce-scatter is ready only after the
last GEMM: Wang et al. sec. 3.2); of the other (n - 1) / n, the share EFFICIENCY hides in
practice, at most the GEMMs' time; and what hides still costs INTERFERENCE = 0.1 of its time
(:mod:`autoplan.cost.overlap`: the SMs and HBM bandwidth the communication kernels take --
TE's userbuffers reduce-scatter runs on 16 SMs of 132 on H100, 12%). At t = 1 nothing is
paid either way. The window is the GEMMs' total, not the layer's: softmax, norms and
element-wise work do not consume an all-gathered input or produce a reduce-scattered output.

**EFFICIENCY = 0.56** is measured, not derived: with EFFICIENCY = 1 the model predicts
torchtitan's Llama 3.1 70B async-TP run (256 H100, FSDP 32 x TP 8, full AC, local batch 16,
seq 8192; torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``) 1.18x faster
than vanilla TP where torchtitan measured 597.3 -> 652.4 tokens/s/GPU, 1.09x; 0.56 is the
value that reproduces that run. What the decomposition loses beyond the one step -- the n
smaller GEMMs' lower efficiency (wave quantization), the copy engines' and NVLink's
sharing with the next GEMM's operand traffic, collectives the compiler does not match
(PyTorch's async-TP announcement reports ~20% faster forward passes but ~8% end to end on
Llama 3 70B) -- is folded into it. Held out: the 8B run of the same page (64 H100, FSDP 8 x
TP 8, per-op SAC, local batch 12: 1.10x measured) -- ``benchmarks/recompute.py`` prints
both.

The step composition applies it (:mod:`autoplan.cost.step`, ``ChunkCost.tp_paid``) to the
chunk's in-layer communication, which under ``tp_comm_overlap`` is TP only (the plan rejects
it with expert or context parallelism, whose all-to-alls and key/value exchanges are not
decomposed this way).

**Backward-only overlap** (``tp_comm_overlap: "backward"``): what Megatron-LM has run by
default since sequence parallelism (Korthikanti et al. 2022; ``megatron/core/tensor_parallel/
layers.py``, ``LinearWithGradAccumulationAndAsyncCommunication``), with no decomposition. In
a column-parallel linear's backward the input gradient's collective -- a reduce-scatter
under sequence parallelism, an all-reduce without -- is launched asynchronously and the
weight-gradient GEMM runs while it travels (one CUDA connection orders the two). Nothing
else moves: the forward's collectives and the row-parallel linears' backward all-gathers
still wait for their GEMMs. So of the backward's TP collectives C_b the share c that are
column-parallel input gradients -- 1/2 under sequence parallelism (two reduce-scatters
beside the two row-parallel all-gathers of a block), 1 without (the all-reduces of the
column-parallel inputs are all there is) -- hides behind the column-parallel weight
gradients::

    paid_bwd(C_b, W_b, c) = C_b - h + INTERFERENCE h,   h = min(c C_b, WGRAD_SHARE W_b)

with W_b the backward seconds of the TP-sharded GEMMs and WGRAD_SHARE the column-parallel
weight gradients' part of them: half (the weight gradient; the other half is the input
gradient) of the column GEMMs' FLOP share, 7/12 for a GPT block (QKV 3h^2 and FC1 4h^2 of 12h^2) and 0.64 for Llama 3
405B's (grouped QKV 1.125h^2 and gate/up 6.5h^2 of 11.9h^2): 0.3. The forward is paid whole.
The local engine runs neither mode (:mod:`engine.runtime` refuses both); they price a plan for
the runtime that does.
"""

from __future__ import annotations

from autoplan.cost.compute import op_kind
from autoplan.cost.overlap import INTERFERENCE


#: Share of the decomposable TP traffic that hides behind its GEMMs (module docstring:
#: torchtitan's measured Llama 3.1 70B async-TP speedup).
EFFICIENCY = 0.56


def paid(comm: float, window: float, steps: int, interference: float = INTERFERENCE,
         efficiency: float = EFFICIENCY) -> float:
    """paid(C, W, n) of the module docstring: seconds of ``comm`` s of TP collectives the
    step still pays when decomposed into ``steps`` beside ``window`` s of GEMMs."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not comm >= 0 or not window >= 0:
        raise ValueError(f"comm and window must be >= 0 seconds, got {comm!r}, {window!r}")
    if steps == 1:
        return comm
    hidden = min(efficiency * comm * (steps - 1) / steps, window)
    return comm - hidden + interference * hidden


#: Column-parallel weight-gradient GEMMs' share of the TP GEMMs' backward seconds (module
#: docstring: half of the column GEMMs' ~0.6 FLOP share in GPT and Llama blocks).
WGRAD_SHARE = 0.3
#: Share c of the backward TP collectives that are column-parallel input gradients (module
#: docstring), with and without sequence parallelism.
BACKWARD_SHARE = {True: 0.5, False: 1.0}


def paid_backward(comm: float, window: float, share: float,
                  interference: float = INTERFERENCE) -> float:
    """paid_bwd(C_b, W_b, c) of the module docstring: seconds of ``comm`` s of backward TP
    collectives the step still pays when the ``share`` of them that are column-parallel
    input gradients run beside the weight-gradient GEMMs (``window``: the TP GEMMs' backward
    seconds)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share!r}")
    if not comm >= 0 or not window >= 0:
        raise ValueError(f"comm and window must be >= 0 seconds, got {comm!r}, {window!r}")
    hidden = min(share * comm, WGRAD_SHARE * window)
    return comm - hidden + interference * hidden


#: (n, c) of a configuration without TP-communication overlap (:func:`tp_overlap`).
NO_OVERLAP = (0, 0.0)


def tp_overlap(p) -> tuple[int, float]:
    """(n, c) of a :class:`~autoplan.plan.ParallelConfig` ``p`` for
    :class:`~autoplan.cost.step.ChunkCost`: the decomposition's steps (the TP degree) under
    ``tp_comm_overlap: true``, the backward-only overlap's share under ``"backward"``
    (:data:`BACKWARD_SHARE`), else none."""
    if p.tp_comm_overlap is True:
        return (p.tp, 0.0)
    if p.tp_comm_overlap == "backward":
        return (0, BACKWARD_SHARE[p.sequence_parallel])
    return NO_OVERLAP


def tp_gemm_nodes(graph) -> frozenset[str]:
    """Nodes of ``graph`` whose compute hides TP collectives under overlap: the matmuls of
    column- and row-parallel ops (Megatron's ColumnParallelLinear / RowParallelLinear)."""
    return frozenset(name for name, node in graph.nodes.items()
                     if node.tp_role in ("column", "row") and op_kind(node) == "matmul")
