"""Overlap of communication with compute: how much of a collective the step actually pays.

Pure functions over seconds (no cluster, no graph): :mod:`autoplan.cost.step` feeds them the
collective times of :mod:`autoplan.cost.comm` and the compute times of
:mod:`autoplan.cost.compute`.

**Interference.** A collective that runs beside compute is not free: NCCL runs one thread
block per channel on its own SM and streams through HBM (NCCL tuning model,
src/graph/tuning.cc; nccl-tests run 8-16 channels on NVSwitch systems). With c channels on a
GPU of S SMs the overlapped kernels lose about c / S of the SMs for the time they overlap:
8-16 of 108 (A100) or 132 (H100) SMs is 6-15%; ``INTERFERENCE`` = 0.1 is the middle of that
range. A hidden collective therefore still costs 0.1 of its time.

**Bounded overlap** (replaces a flat "90% hidden"): a collective of C seconds can hide only
behind the W seconds of compute that run while it is in flight *and do not depend on it*::

    x(C, W) = max(0, C - W) + INTERFERENCE * min(C, W)

**Bucketed gradient reduction** (DDP, Li et al. VLDB 2020, sec. 3.2.3; Megatron-LM's
overlapped grad reduce): gradients are reduced in buckets as backward produces them, so the
reduction overlaps the backward of the micro-batch that completes them -- except the last
bucket, whose gradients are ready only when backward ends::

    reduction(A, W, A_last) = A_last + x(A - A_last, W)

with A the whole reduction, A_last the last bucket's (``bucket_bytes`` of gradients; PyTorch
DDP's default ``bucket_cap_mb`` is 25 MiB, Megatron-LM buckets ~40M parameters).

**ZeRO-3 / FSDP per-unit pattern** (Rajbhandari et al. 2019, sec. 5.3 and 7.2.2; Zhao et al.
2023 "PyTorch FSDP", sec. 3.3-3.4): the model is split into U units (FSDP's wrapped modules,
one per transformer block). Per micro-batch, each unit's parameters are all-gathered before
its forward, freed after it (``reshard_after_forward``), all-gathered again before its
backward, and its gradients reduce-scattered after it. One communication stream; the next
unit's all-gather is issued while the current unit computes (prefetch depth 1: FSDP's
``forward_prefetch`` / ``BACKWARD_PRE``). For homogeneous units with per-unit compute f
(forward), b (backward, including a recomputed forward), all-gather g and reduce-scatter r::

    forward  = g + (U - 1) max(f, g) + f
    backward = g + (U - 1) max(b, g + r) + b + r
    exposed  = forward + backward - U (f + b), plus INTERFERENCE of the hidden traffic

The first gather and the last reduce-scatter never hide; a unit whose collectives take
longer than its compute (small micro-batch, many ranks: the gather's ring latency grows with
the ranks, :mod:`autoplan.cost.comm`) exposes the difference in every unit, every
micro-batch -- which is why ZeRO-3 throughput falls as a fixed global batch is spread over
more GPUs.
"""

from __future__ import annotations

#: Fraction of an overlapped collective's time still paid (NCCL's SMs; module docstring).
INTERFERENCE = 0.1
#: PyTorch DDP's default gradient bucket (``bucket_cap_mb=25``).
DDP_BUCKET_BYTES = 25 * 2 ** 20


def _check(**values: float) -> None:
    for name, v in values.items():
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0 seconds, got {v!r}")


def exposed(comm: float, window: float, interference: float = INTERFERENCE) -> float:
    """x(C, W): seconds a collective of ``comm`` s adds when only ``window`` s of
    independent compute can run beside it."""
    _check(comm=comm, window=window)
    hidden = min(comm, window)
    return comm - hidden + interference * hidden


def bucketed_reduction(total: float, window: float, last_bucket: float,
                       interference: float = INTERFERENCE) -> float:
    """Exposed seconds of a gradient reduction of ``total`` s in buckets overlapped with
    ``window`` s of backward; the last bucket (``last_bucket`` s) cannot hide."""
    _check(total=total, window=window, last_bucket=last_bucket)
    tail = min(last_bucket, total)
    return tail + exposed(total - tail, window, interference)


def zero3_micro_batch(units: int, gather: float, reduce_scatter: float, fwd: float,
                      bwd: float, *, reshard_after_forward: bool = True,
                      interference: float = INTERFERENCE) -> float:
    """Exposed seconds of ZeRO-3's collectives in one micro-batch (module docstring):
    ``units`` equal units, each with ``gather`` / ``reduce_scatter`` seconds of
    communication and ``fwd`` / ``bwd`` seconds of compute. Without
    ``reshard_after_forward`` (ZeRO-2-like FSDP) backward gathers nothing."""
    _check(gather=gather, reduce_scatter=reduce_scatter, fwd=fwd, bwd=bwd)
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ValueError(f"units must be a positive integer, got {units!r}")
    g_b = gather if reshard_after_forward else 0.0
    forward = gather + (units - 1) * max(fwd, gather) + fwd
    backward = g_b + (units - 1) * max(bwd, g_b + reduce_scatter) + bwd + reduce_scatter
    stall = forward + backward - units * (fwd + bwd)
    traffic = units * (gather + g_b + reduce_scatter)
    return stall + interference * max(0.0, traffic - stall)
