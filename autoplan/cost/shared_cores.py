"""Ranks sharing CPU cores: the machine's capacity bounds the step.

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
    T_dep = s · T_pipeline                                      (the GPU composition's step at
                                                                 share s, at a full core)

with ``s = min(1, C/N)``, the share every op and collective time is already scaled by
(:mod:`autoplan.cost.profiled`), so ``W_d`` is rank d's CPU seconds / s and the average over
ranks times N / C is exactly ``sum W / C``. Two things differ from the GPU composition
(:mod:`autoplan.cost.step`, which composes both: shared cores are a property of its
:class:`~autoplan.cost.step.StepModel`, this module's :class:`SharedCores`), both because the "device" is the same cores
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
is the GPU composition's.

This module holds the parameters of that composition (:class:`SharedCores`) and how the
engine's TP collectives are counted (:func:`tp_collectives`, :meth:`SharedCores.split_time`);
:mod:`autoplan.cost.step` composes them.

Sources and checks: per-rank CPU seconds of the engine's ranks (``time.process_time``) on
this 2-core machine, summed over the 4 ranks and divided by the wall time of a step, came to
1.2-1.3 cores for ten plans — DP, ZeRO-1/3, recomputation, TP 2/4, PP 2/4 — with other users'
processes taking the rest: the capacity bound is what binds here.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.comm import CommModel, Group
from autoplan.cost.compute import op_kind
from autoplan.graph import Layer, OpGraph


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


@dataclass(frozen=True)
class SharedCores:
    """``share`` = min(1, C / N) of a core per rank, and the measured framework overheads
    (:mod:`autoplan.cost.framework_overhead`) the composition adds on shared cores."""

    share: float
    optimizer_scale: float = 1.0
    tp_matmul_overhead_s: float = 0.0
    dp_module_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be in (0, 1], got {self.share!r}")

    def matmul_overhead(self, matmuls: int) -> float:
        """DTensor's per-module work of ``matmuls`` sharded matmuls in one direction (half
        of ``tp_matmul_overhead_s`` each), at the core share."""
        return matmuls * self.tp_matmul_overhead_s / 2 / self.share

    @staticmethod
    def split_time(comm: CommModel, collective: str, nbytes: float, count: int,
                   group: Group) -> float:
        """``nbytes`` moved in ``count`` collectives of equal size, as the engine issues
        them (one per consumer), rather than one collective of the sum."""
        n = max(count, 1)
        return n * comm.time(collective, nbytes / n, group)
