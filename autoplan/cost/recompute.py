"""Activation recomputation modes: none, selective (the attention core), op, full.

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

In a traced graph the attention core is found from each block's softmax: the ops on
tensors of its shape back to the Q K^T matmul and on to the matmul with V
(:func:`attention_core`), and the fused attention ops (``F.scaled_dot_product_attention``: flash / memory-efficient kernels
keep no attention matrix, only their inputs, output and log-sum-exp, so there selective
recomputation saves almost nothing and costs the kernel's forward again, and the grid
does not enumerate it: :mod:`autoplan.planner.grid.uniform`).

The one place those ops are named is :func:`attention_core`; the step composition
(:mod:`autoplan.cost.step`) prices their forward once more per micro-batch, and
:func:`autoplan.cost.memory.activation_bytes` drops their attention matrices from what a
selectively recomputed layer keeps.

*Op-level* recomputation (``op``) is torchtitan's per-op selective activation checkpointing
(``[activation_checkpoint] mode = "selective"``, ``selective_ac_option = "op"``; torchtitan
``parallelisms/parallelize_llama.py`` at 9dec370, Dec. 2024, the policy its Llama 3.1 8B
benchmarks ran): in each block the outputs of the attention kernels, of the sequence-parallel
reduce-scatters and of every other matmul -- the 1st, 3rd, ... in forward order -- are saved;
everything else (the other matmuls, norms, activation functions, residual adds,
all-gathers) runs again in backward. Per layer and micro-batch it keeps the layer's input
and those saved outputs (:func:`op_saved_nodes`; under TP a column matmul's output and the
attention's are 1/t, a row matmul's partial sum is whole, its reduce-scattered output 1/t),
and recomputes the forward of the rest (:func:`op_recomputed_nodes`) plus, under sequence
parallelism, the all-gathers before the column matmuls (the reduce-scatters' outputs are
saved: half of the forward's TP communication), without it the row matmuls' all-reduces (all
of it). A Llama block (q, k, v, o, w1, w3, w2) keeps q, v, w1 and w2's outputs and the
attention's and recomputes k, o and w3 -- for Llama 3 8B 37% of its matmul FLOPs (h^2/4 +
h^2 + 3.5 h^2 of 13 h^2) -- and everything element-wise; ``engine.recompute`` runs the
same policy. Korthikanti et al.'s formulas have no such mode (:func:`korthikanti_layer_bytes`
refuses it).
"""

from __future__ import annotations

from autoplan.cost.compute import op_base_name, op_kind
from autoplan.plan_parts import RECOMPUTE_MODES   # the modes a plan names, least recomputed first

__all__ = ["OP_MATMULS", "RECOMPUTE_MODES", "attention_core", "core_fwd_flops",
           "korthikanti_layer_bytes", "op_kept_bytes", "op_node_sets", "op_recomputed_nodes",
           "op_saved_nodes"]


_SOFTMAX = ("softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax")
_MATMUL = ("bmm", "matmul", "baddbmm", "einsum")


def attention_core(graph) -> frozenset[str]:
    """Names of the nodes of ``graph``'s blocks that selective recomputation recomputes
    (module docstring): the fused attention ops; and around each softmax of a block, the
    ops producing its input back to the Q K^T matmul (scale, mask) and those consuming its
    output up to the matmul with V (dropout), following only tensors of the softmax's shape
    and views of them (so a causal mask built from constants is not part of it). Callers keep the result (one
    pass over the graph)."""
    consumers: dict[str, list[str]] = {}
    for name, node in graph.nodes.items():
        for src in node.inputs:
            consumers.setdefault(src, []).append(name)

    def shape(name: str) -> tuple:
        meta = graph.nodes[name].output_meta
        return tuple(meta[0].shape) if meta else ()

    out: set[str] = set()
    for layer in graph.layers:
        if layer.name.startswith("<"):          # blocks only ("<pre>", "<post>" are not)
            continue
        members = set(layer.nodes)
        for name in layer.nodes:
            node = graph.nodes[name]
            kind, base = op_kind(node), node.op.split(".")[1] if "." in node.op else node.op
            if kind == "attention":
                out.add(name)
                continue
            if base not in _SOFTMAX:
                continue
            attn = shape(name)
            out.add(name)
            for step, frontier in (("up", list(node.inputs)), ("down", consumers.get(name, []))):
                todo = list(frontier)
                while todo:
                    n = todo.pop()
                    if n in out or n not in members:
                        continue
                    nd = graph.nodes[n]
                    b = nd.op.split(".")[1] if "." in nd.op else nd.op
                    if b in _MATMUL:                 # Q K^T (up) or P V (down): the ends
                        out.add(n)
                        continue
                    if shape(n) != attn and op_kind(nd) != "view":   # another tensor
                        continue
                    out.add(n)
                    todo += list(nd.inputs) if step == "up" else consumers.get(n, [])
    return frozenset(out)


#: Matmuls counted by the op-level policy (linear layers, with or without bias).
OP_MATMULS = ("mm", "addmm")


def op_saved_nodes(graph) -> frozenset[str]:
    """Nodes of ``graph``'s blocks whose outputs op-level recomputation keeps (module
    docstring): the fused attention ops and the 1st, 3rd, ... ``mm`` / ``addmm`` of each
    block in execution order."""
    out: set[str] = set()
    for layer in graph.layers:
        if layer.name.startswith("<"):
            continue
        count = 0
        for name in layer.nodes:
            node = graph.nodes[name]
            if op_kind(node) == "attention":
                out.add(name)
            elif op_base_name(node.op) in OP_MATMULS:
                count += 1
                if count % 2 == 1:
                    out.add(name)
    return frozenset(out)


def op_recomputed_nodes(graph, saved: frozenset[str] | None = None) -> frozenset[str]:
    """Nodes of ``graph``'s blocks that op-level recomputation runs again in backward: every
    op with work (not a view, not a collective) outside :func:`op_saved_nodes`."""
    saved = op_saved_nodes(graph) if saved is None else saved
    return frozenset(name for layer in graph.layers if not layer.name.startswith("<")
                     for name in layer.nodes
                     if name not in saved and op_kind(graph.nodes[name]) not in ("view", "comm"))


def op_node_sets(graph) -> tuple[frozenset[str], frozenset[str]]:
    """(:func:`op_saved_nodes`, :func:`op_recomputed_nodes`) of ``graph``, one pass each."""
    saved = op_saved_nodes(graph)
    return saved, op_recomputed_nodes(graph, saved)


def op_kept_bytes(graph, index: int, saved: frozenset[str], grows) -> tuple[float, ...]:
    """Bytes, at the traced micro-batch, of layer ``index``'s tensors that op-level
    recomputation keeps (module docstring), among the outputs ``grows(name)`` says grow with
    the batch: the saved ops' outputs split by how TP divides them -- column and sharded
    (1/t), replicated (1/t under sequence parallelism), row (a whole partial sum) -- and
    the outputs of all its row matmuls (reduce-scattered: 1/t, under sequence parallelism)."""
    split = rep = row = rows = 0.0
    for name in graph.layers[index].nodes:
        node = graph.nodes[name]
        if not grows(name):
            continue
        out = float(sum(m.nbytes for m in node.output_meta))
        if node.tp_role == "row" and op_kind(node) == "matmul":
            rows += out
        if name in saved:
            if node.tp_role in ("column", "sharded"):
                split += out
            elif node.tp_role == "row":
                row += out
            else:
                rep += out
    return split, rep, row, rows


def core_fwd_flops(graph, layers=None, core: frozenset[str] | None = None) -> float:
    """Forward FLOPs of the attention core of ``layers`` (indices; default all) at the
    traced micro-batch: what selective recomputation repeats, which the hardware-FLOP
    count adds. ``core``: :func:`attention_core` of the graph, if the caller keeps it."""
    core = attention_core(graph) if core is None else core
    idx = range(len(graph.layers)) if layers is None else layers
    return float(sum(graph.nodes[n].fwd_flops for i in idx for n in graph.layers[i].nodes
                     if n in core))


def korthikanti_layer_bytes(mode: str, *, s: int, b: int, h: int, a: int, t: int = 1,
                            sequence_parallel: bool = True) -> float:
    """Activation bytes of one transformer layer per micro-batch, Korthikanti et al. 2022
    eq. 1-2 / Table 2 (16-bit activations): none s b h (10 + 24/t + 5 a s/(h t)) (without
    sequence parallelism; /t throughout with it), selective s b h 34 / t (with SP;
    s b h (10 + 24/t) without), full 2 s b h (/t with SP)."""
    if mode not in RECOMPUTE_MODES or mode == "op":
        raise ValueError(f"Korthikanti et al.'s modes are none, selective and full, "
                         f"got {mode!r}")
    sbh = float(s) * b * h
    if mode == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attn = 0.0 if mode == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 + attn) / t
    return sbh * (10 + 24 / t + attn / t)
