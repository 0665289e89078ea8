"""Activation recomputation modes: none, selective (the attention core), full.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198), sec. 4-5. Per transformer layer and micro-batch, with 16-bit
activations, sequence s, micro-batch b, hidden h, heads a, tensor parallelism t with sequence
parallelism (eq. 1-2 and sec. 5, Table 2):

    none        s b h (34 + 5 a s / h) / t      bytes kept for backward
    selective   s b h 34 / t                    the attention core's 5 a s / h term dropped
    full        2 s b h / t                     the layer input only

*Selective* recomputation recomputes only the attention core -- Q K^T, the scale and mask,
the softmax, the softmax dropout and the attention over V -- in backward: the operations
whose saved tensors are the (b, a, s, s) attention matrices (2 a s^2 b for Q K^T, 2 a s^2 b
for the softmax output, a s^2 b for the dropout mask = 5 a s^2 b, the 5 a s / h term) but
whose FLOPs are a small part of the layer's: two matmuls of 2 b s^2 h FLOPs each, 4 b s^2 h
of the layer's forward 24 b s h^2 + 4 b s^2 h (Narayanan et al. 2021, sec. 5.1). Sec. 5's
examples: GPT-3 (a = 96, s = 2048, h = 12288: 5 a s / h = 80) keeps 70% less activation
memory with selective recomputation (80 / 114), MT-NLG 530B (a = 128, s = 2048,
h = 20480: 64) 65% less (64 / 98) -- ``tests/test_recompute.py`` checks
:func:`korthikanti_layer_bytes` against both. The extra FLOPs, over a training step's
72 b s h^2 (1 + s / (6 h)) per layer, are s / (18 h (1 + s / (6 h))): 0.9% for GPT-3, 0.55%
for MT-NLG, against a third of the step for full recomputation.

In a traced graph the attention core is the ops of a block that produce or read an
attention-matrix-shaped tensor (``(..., s, s)``, :mod:`autoplan.trace.saved`'s test) and the
fused attention ops (``F.scaled_dot_product_attention``: flash / memory-efficient kernels
keep no attention matrix, only their inputs, output and log-sum-exp, so there selective
recomputation saves almost nothing and costs the kernel's forward again, and the grid
does not enumerate it: :mod:`autoplan.planner.uniform`).

The one place those ops are named is :func:`attention_core`; the step composition
(:mod:`autoplan.cost.step`) prices their forward once more per micro-batch, and
:func:`autoplan.cost.memory.activation_bytes` drops their attention matrices from what a
selectively recomputed layer keeps.
"""

from __future__ import annotations

from autoplan.cost.compute import op_kind
from autoplan.plan_parts import RECOMPUTE_MODES   # the modes a plan names, least recomputed first

__all__ = ["RECOMPUTE_MODES", "attention_core", "core_fwd_flops", "korthikanti_layer_bytes"]


def _attention_shaped(shape: tuple[int, ...], seq_len: int | None) -> bool:
    if len(shape) < 3 or shape[-1] != shape[-2] or shape[-1] <= 1:
        return False
    return seq_len is None or shape[-1] == seq_len


def attention_core(graph) -> frozenset[str]:
    """Names of the nodes of ``graph``'s blocks that selective recomputation recomputes
    (module docstring): fused attention ops, and the non-view ops writing or reading an
    attention-matrix-shaped tensor (Q K^T, scale, mask, softmax, dropout, attention x V).
    Callers keep the result (one pass over the graph)."""
    seq = graph.batch.seq_len
    out = set()
    for layer in graph.layers:
        if layer.name.startswith("<"):          # blocks only ("<pre>", "<post>" are not)
            continue
        for name in layer.nodes:
            node = graph.nodes[name]
            kind = op_kind(node)
            if kind == "attention":
                out.add(name)
            elif kind not in ("view", "comm") and (
                    any(_attention_shaped(tuple(m.shape), seq) for m in node.output_meta)
                    or any(_attention_shaped(tuple(m.shape), seq) for m in node.input_meta)):
                out.add(name)
    return frozenset(out)


def core_fwd_flops(graph, layers=None) -> float:
    """Forward FLOPs of the attention core of ``layers`` (indices; default all) at the
    traced micro-batch: what selective recomputation repeats, which the hardware-FLOP
    count adds."""
    core = attention_core(graph)
    idx = range(len(graph.layers)) if layers is None else layers
    return float(sum(graph.nodes[n].fwd_flops for i in idx for n in graph.layers[i].nodes
                     if n in core))


def korthikanti_layer_bytes(mode: str, *, s: int, b: int, h: int, a: int, t: int = 1,
                            sequence_parallel: bool = True) -> float:
    """Activation bytes of one transformer layer per micro-batch, Korthikanti et al. 2022
    eq. 1-2 / Table 2 (16-bit activations): none s b h (10 + 24/t + 5 a s/(h t)) (without
    sequence parallelism; /t throughout with it), selective s b h 34 / t (with SP;
    s b h (10 + 24/t) without), full 2 s b h (/t with SP)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    sbh = float(s) * b * h
    if mode == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attn = 0.0 if mode == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 + attn) / t
    return sbh * (10 + 24 / t + attn / t)
