"""An op of a traced graph at another micro-batch: which tensors grow with the batch.

The planner traces a model once, at micro-batch ``b0`` (usually 1), and scales FLOPs, bytes
and activations linearly to the micro-batch ``b`` a configuration runs. An op profile, though,
is keyed by exact shapes (:mod:`autoplan.profile.signature`), so to look an op up at ``b``
its shapes must be those of the graph traced at ``b``. This module derives them from the
graph at ``b0`` alone.

Which tensors depend on the batch (dataflow, :func:`batch_tensors`): the model's inputs
(``graph.batch.input_shapes``: tokens, targets) do; a node's output does iff one of its
activation inputs does. Parameters and what is computed from them or from constants alone
(``t(weight)``, ``arange`` and the position embedding it indexes) do not. A node's tensor
arguments (``input_meta``) are matched to its producers (``OpNode.inputs``) by shape and
dtype; an argument no producer made is batch-dependent if its shape and dtype are those of a
graph input or of the output of a node fed by graph inputs alone (the tracer does not list
such nodes as producers: ``targets.view(-1)`` feeding the loss), else it is a parameter or
constant. Each producer is matched to one argument first; arguments left over then match any
producer of their shape, since one producer may feed several arguments (a fused q/k/v
projection's ``unbind`` feeding attention its q, k and v: ViT). Arguments of one op with equal
shape and dtype scale alike (if one grows with the batch, so do the others: attention's q, k
and v must keep equal batch dims, or ``sdpa_flop_count`` asserts on the scaled shapes) — except
an argument a producer answered for, whose answer stands. An argument no producer made that has
the shape of a parameter the op reads (``OpNode.params``; transposed too, ``t(weight)``) is that
parameter, checked before the shared-producer and equal-shape rules: a weight never scales, even
where its shape is that of the activation beside it (gpt-tiny's addmm, ``(b·s, h)`` input and
``(h, h)`` weight, at ``b·s = h``).

Which dim (:func:`scaled_node`): dim 0 of every batch-dependent tensor is multiplied by
``k = b / b0`` — the batch dim of batch-first models, or the flattened ``batch x sequence``
dim of the 2-D views that matmuls run on (``(b·s, h)``). Every model autoplan traces is
batch-first (its GPT, Hugging Face causal LMs, torchvision-style CNNs). Sequence-first
models (``(s, b, h)``) would get the wrong dim: their ops then miss the profile and fall back
to interpolation or the roofline — slower planning, not a wrong answer. If ``k · dim 0`` is
not a whole number the op is not scaled (None).

Checked against the graph traced at ``b`` directly: every node of gpt-tiny and gpt-small at
``b0 = 1`` scaled to 2, 4 and 8 has the shapes of the graph traced at that batch
(``tests/test_calibrate.py``).
"""

from __future__ import annotations

from dataclasses import replace

from autoplan.graph import OpGraph, OpNode, TensorMeta


def batch_tensors(graph: OpGraph) -> dict[str, tuple[tuple[bool, ...], bool]]:
    """node name -> (per ``input_meta`` entry: does it depend on the batch?, does the
    output?) — the dataflow rule of the module docstring."""
    from_inputs = {(tuple(shape), dtype) for shape, dtype in
                   zip(graph.batch.input_shapes, graph.batch.input_dtypes)}
    out_flag: dict[str, bool] = {}
    result: dict[str, tuple[tuple[bool, ...], bool]] = {}
    for node in graph.nodes.values():
        producers = [(graph.nodes[p].output_meta, out_flag.get(p, False))
                     for p in node.inputs if p in graph.nodes]
        used: set[int] = set()
        weights = _param_shapes(graph, node)
        flags = []
        produced = []           # per argument: did a producer or a parameter answer for it?
        for meta in node.input_meta:
            flag = None
            for j, (outs, dep) in enumerate(producers):
                if j not in used and any(o.shape == meta.shape and o.dtype == meta.dtype
                                         for o in outs):
                    used.add(j)
                    flag = dep
                    break
            if flag is None:        # a parameter the op reads (``t(weight)`` too): never
                # the batch, even where its shape is an activation's (addmm's (h, h) weight
                # beside its (b*s, h) input at b*s = h)
                hit = next((i for i, shapes in enumerate(weights)
                            if tuple(meta.shape) in shapes), None)
                if hit is not None:
                    weights.pop(hit)
                    flag = False
            if flag is None:        # one producer feeding several arguments: fused q/k/v
                # split into three views of one output, all three read by attention
                flag = next((dep for outs, dep in producers
                             if any(o.shape == meta.shape and o.dtype == meta.dtype
                                    for o in outs)), None)
            produced.append(flag is not None)
            if flag is None:
                flag = (tuple(meta.shape), meta.dtype) in from_inputs
            flags.append(flag)
        # equal-shaped arguments (q, k, v) scale alike -- but only an argument no producer
        # or parameter answered for is promoted: one that was answered for keeps its answer,
        # so a weight never scales with the activation of its shape beside it
        same: dict[tuple, bool] = {}
        for meta, flag in zip(node.input_meta, flags):
            key = (tuple(meta.shape), meta.dtype)
            same[key] = same.get(key, False) or flag
        flags = [f if known else same[(tuple(m.shape), m.dtype)]
                 for m, f, known in zip(node.input_meta, flags, produced)]
        dep = any(flags) or any(d for _, d in producers)
        out_flag[node.name] = dep
        if dep and not producers:
            from_inputs.update((tuple(m.shape), m.dtype) for m in node.output_meta)
        result[node.name] = (tuple(flags), dep)
    return result


def _param_shapes(graph: OpGraph, node: OpNode) -> list[set[tuple[int, ...]]]:
    """Per parameter ``node`` reads: the shapes its argument may have (the parameter's, or
    transposed: ``addmm`` reads ``t(weight)``)."""
    out = []
    for name in node.params:
        info = graph.params.get(name)
        if info is not None:
            shape = tuple(info.shape)
            out.append({shape, shape[::-1]})
    return out


def _scale_meta(meta: TensorMeta, k: float) -> TensorMeta | None:
    if not meta.shape:
        return meta
    new = meta.shape[0] * k
    if abs(new - round(new)) > 1e-9 or round(new) < 1:
        return None
    return TensorMeta((int(round(new)), *meta.shape[1:]), meta.dtype)


def scaled_node(node: OpNode, flags: tuple[tuple[bool, ...], bool], k: float
                ) -> OpNode | None:
    """``node`` at ``k`` times the traced micro-batch (None if a dim would not be whole).

    FLOPs and bytes scale by ``k`` (what the planner assumes); only the shapes are exact.
    """
    if k == 1:
        return node
    in_flags, out_dep = flags
    ins = [(_scale_meta(m, k) if f else m) for m, f in zip(node.input_meta, in_flags)]
    outs = [(_scale_meta(m, k) if out_dep else m) for m in node.output_meta]
    if any(m is None for m in (*ins, *outs)):
        return None
    return replace(node, input_meta=ins, output_meta=outs, fwd_flops=node.fwd_flops * k,
                   bwd_flops=node.bwd_flops * k, bytes_read=int(node.bytes_read * k),
                   bytes_written=int(node.bytes_written * k))
