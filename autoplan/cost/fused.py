"""Activations as fused GPU kernels keep them, from a graph traced op by op.

The tracer records what eager aten ops save for backward. Two patterns of Llama-style blocks
are saved very differently by the fused kernels GPU training runs (Megatron-LM / Transformer
Engine, torchtitan, FlashAttention):

* **RMSNorm**. Traced op by op, the norm upcasts its input to fp32 and saves the fp32 copy
  and the fp32 normalised product (4 + 4 bytes per element) beside a tiny rstd. A fused
  RMSNorm kernel (apex ``FusedRMSNorm``, TE ``RMSNorm``, ``torch.nn.functional.rms_norm``'s
  CUDA kernel) saves its 16-bit input and the fp32 rstd per row: 2 bytes per element.
* **Grouped-query attention**. Traced, k and v are expanded (``expand`` + ``clone``) to all
  query heads and saved that way; FlashAttention-2/3 take the kv heads as they are (GQA
  support) and save k and v at kv-head size: 1 / (heads / kv_heads) of the expanded copy.
* **SwiGLU**. Traced, ``silu(gate) * up`` keeps the gate, silu(gate) (for the product's
  backward), up and the product (the down projection's input). A fused SwiGLU keeps its
  input (gate and up) and recomputes silu(gate) in backward (Megatron-LM
  ``megatron/core/fusions/fused_bias_swiglu.py``: ``SwiGLUFunction`` saves only its input;
  Transformer Engine's ``swiglu``; torch.compile's partitioner recomputes the pointwise
  silu): the silu output feeding a ``mul`` is not kept.

For a Llama 3 block this takes the saved bytes from ~56 to ~41 per token per hidden unit
with the first two (issue 13 measured ~54 against ~38 on other shapes), and by another
2 x ffn / hidden (6.5 for Llama 3 405B, ffn = 3.25 h) with the third. :func:`fuse_saved_activations` returns
the graph with these nodes' ``saved_bytes`` and their layers' ``LayerStats`` adjusted, so
both planners (per layer and per op) price the same bytes.
"""

from __future__ import annotations

from dataclasses import replace

from autoplan.graph import Layer, OpGraph, OpNode

_NORM_TYPES = ("RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
_FLOAT_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}


def _swiglu_silus(graph: OpGraph) -> set[str]:
    """Names of the silu ops whose output feeds a ``mul`` (SwiGLU; module docstring)."""
    silus = {n for n, node in graph.nodes.items() if node.op.startswith("aten.silu")}
    return {i for node in graph.nodes.values() if node.op.startswith("aten.mul")
            for i in node.inputs if i in silus}


def _fused_saved(node: OpNode, compute_width: int, swiglu: set[str] = frozenset()) -> int:
    """Bytes ``node``'s outputs keep for backward under fused kernels (module docstring)."""
    if not node.saved_bytes or not node.output_meta:
        return node.saved_bytes
    if node.name in swiglu:
        return 0                                     # recomputed by the fused SwiGLU
    meta = node.output_meta[0]
    if node.module_type in _NORM_TYPES and _FLOAT_WIDTH.get(meta.dtype, 0) > compute_width:
        if node.op.startswith("aten.rsqrt"):
            return node.saved_bytes                  # rstd: one fp32 per row, kept
        # the fp32 copy becomes the 16-bit input the fused kernel keeps; the product goes
        return node.saved_bytes * compute_width // 4 if node.op.startswith("aten._to_copy") \
            else 0
    shape = meta.shape
    if (node.op.startswith(("aten.clone", "aten.expand")) and len(shape) == 5
            and shape[2] > 1):                       # (b, kv_heads, rep, s, head_dim)
        return node.saved_bytes // shape[2]
    return node.saved_bytes


def fuse_saved_activations(graph: OpGraph) -> OpGraph:
    """``graph`` with saved bytes as fused kernels keep them (module docstring); the same
    graph object when nothing changes. The per-layer sums change by the same bytes (the
    TP-sharded part by the sharded ops' change)."""
    widths = [_FLOAT_WIDTH.get(m.dtype, 4) for n in graph.nodes.values() for m in n.input_meta
              if m.dtype in _FLOAT_WIDTH]
    compute_width = min(widths, default=4)
    if compute_width >= 4:
        return graph                                 # fp32 training: nothing is upcast
    nodes, delta, delta_tp = {}, {}, {}
    swiglu = _swiglu_silus(graph)
    for name, node in graph.nodes.items():
        kept = _fused_saved(node, compute_width, swiglu)
        if kept != node.saved_bytes:
            d = node.saved_bytes - kept
            delta[node.layer] = delta.get(node.layer, 0) + d
            if node.tp_role in ("column", "sharded"):
                delta_tp[node.layer] = delta_tp.get(node.layer, 0) + d
            node = replace(node, saved_bytes=kept)
        nodes[name] = node
    if not delta:
        return graph
    layers = []
    for layer in graph.layers:
        d, d_tp = delta.get(layer.index, 0), delta_tp.get(layer.index, 0)
        st = layer.stats
        if d:
            st = replace(st, saved_bytes=max(0, st.saved_bytes - d),
                         saved_bytes_tp=max(0, st.saved_bytes_tp - d_tp))
        layers.append(Layer(layer.index, layer.name, layer.kind, layer.nodes, st))
    return replace(graph, nodes=nodes, layers=layers)
