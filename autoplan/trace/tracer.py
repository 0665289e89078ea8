"""The tracer's entry points: an ``nn.Module`` (or a :class:`ModelSpec`) in, an OpGraph out.

    graph = trace(resolve("gpt3-175b"), batch_size=1, seq_len=2048, dtype=torch.float16)
    graph = trace_module(model, (tokens, targets))                  # model, batch on meta
    graph = trace_module(model, input_spec=[((8, 128), torch.long), ((8, 128), torch.long)])

Steps: :func:`~autoplan.trace.capture.capture` (one forward and backward on the meta
device), :func:`~autoplan.trace.layers.detect_layers`, TP roles per layer
(:mod:`~autoplan.trace.roles`), saved activations (:mod:`~autoplan.trace.saved`), and the
per-layer aggregates (:mod:`~autoplan.trace.stats`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import Counter
from typing import Any, Sequence

import torch
import torch.nn as nn

from autoplan.errors import ConfigError
from autoplan.graph import (DTYPE_BYTES, BatchSpec, Layer, OpGraph, OpNode, ParamInfo, TensorMeta,
                            TPRole)
from autoplan.models.moe import expert_layers
from autoplan.trace.capture import Capture, capture
from autoplan.trace.dataflow import Dataflow
from autoplan.trace.layers import LayerSpan, detect_layers
from autoplan.trace.roles import layer_roles, param_tp_dim
from autoplan.trace.saved import summarize_saved
from autoplan.trace.stats import boundary_bytes, layer_stats

InputSpec = Sequence[tuple[Sequence[int], torch.dtype]]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in t.shape), _dtype_name(t.dtype))


def module_fingerprint(model: nn.Module) -> str:
    """sha256 over the model's class, module tree and parameter/buffer shapes (16 hex)."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, module in model.named_modules():
        h.update(f"m:{name}:{type(module).__qualname__};".encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"t:{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def _batch_from_spec(input_spec: InputSpec, device: torch.device) -> tuple[torch.Tensor, ...]:
    batch = []
    for i, item in enumerate(input_spec):
        try:
            shape, dtype = item
            batch.append(torch.empty(tuple(shape), dtype=dtype, device=device))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"input_spec[{i}] must be (shape, dtype), got {item!r}",
                              field=f"input_spec[{i}]") from exc
    return tuple(batch)


def _batch_spec(inputs: list[torch.Tensor], seq_len: int | None) -> BatchSpec:
    if seq_len is None and inputs:
        first = inputs[0]
        if first.dim() == 2 and not first.is_floating_point():
            seq_len = int(first.shape[1])           # (batch, tokens)
    return BatchSpec(
        batch_size=int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1,
        seq_len=seq_len,
        input_shapes=tuple(tuple(int(d) for d in t.shape) for t in inputs),
        input_dtypes=tuple(_dtype_name(t.dtype) for t in inputs))


def _param_infos(cap: Capture, flow: Dataflow, layer_of: list[int], roles: list[TPRole],
                 spans: list[LayerSpan]) -> dict[str, ParamInfo]:
    ops, tensors = cap.ops, cap.params
    first_reader: dict[str, int] = {}
    sharding: dict[str, tuple[TPRole, int | None]] = {}
    for op in ops:
        if op.is_view:
            continue
        for _, fqn in flow.io[op.index].params:
            first_reader.setdefault(fqn, op.index)
            role = roles[op.index]
            if fqn not in sharding or sharding[fqn][0] not in ("column", "row"):
                dim = param_tp_dim(op, tensors[fqn], role)
                sharding[fqn] = (role if dim is not None else "replicated", dim)
    infos: dict[str, ParamInfo] = {}
    for fqn, p in tensors.items():
        if fqn in first_reader:
            layer = layer_of[first_reader[fqn]]
        else:       # never read: the layer of the block holding it, else <pre>
            layer = next((k for k, s in enumerate(spans)
                          if fqn.startswith(s.name + ".")), 0)
        role, dim = sharding.get(fqn, ("replicated", None))
        infos[fqn] = ParamInfo(fqn, tuple(int(d) for d in p.shape), _dtype_name(p.dtype),
                               layer, role, dim)
    return infos


def _mark_experts(model: nn.Module, params: dict[str, ParamInfo], batch: BatchSpec,
                  num_layers: int) -> list[int]:
    """Mark the expert weights of ``model``'s MoE modules in ``params`` (in place) and return
    each layer's expert all-to-all bytes at the traced batch (:mod:`autoplan.models.moe`)."""
    a2a = [0] * num_layers
    tokens = batch.batch_size * (batch.seq_len or 1)
    for moe in expert_layers(model):
        names = [n for n in moe.params if n in params]
        for n in names:
            params[n] = dataclasses.replace(params[n], experts=moe.experts, top_k=moe.top_k)
        if names:
            p = params[names[0]]
            a2a[p.layer] += moe.a2a_bytes(tokens, DTYPE_BYTES.get(p.dtype, 4))
    return a2a


def graph_dtype(params: dict[str, ParamInfo]) -> str:
    """The graph's dtype: the most common floating dtype among its parameters (float32 when
    it has none)."""
    floats = Counter(p.dtype for p in params.values() if p.dtype.startswith(("float", "bfloat")))
    return floats.most_common(1)[0][0] if floats else "float32"


def _graph_from_capture(model: nn.Module, cap: Capture, *, model_name: str, fingerprint: str,
                        seq_len: int | None) -> OpGraph:
    ops = cap.ops
    flow = Dataflow.build(cap)
    spans = detect_layers(model, ops)
    layer_of = [0] * len(ops)
    for k, span in enumerate(spans):
        for i in range(span.start, span.stop):
            layer_of[i] = k
    roles: list[TPRole] = ["replicated"] * len(ops)
    for span in spans:
        for i, role in layer_roles(ops, flow, span.start, span.stop).items():
            roles[i] = role
    batch = _batch_spec(cap.input_tensors, seq_len)
    saved = summarize_saved(cap, layer_of, roles, len(spans), batch.seq_len)
    params = _param_infos(cap, flow, layer_of, roles, spans)
    entering, leaving = boundary_bytes(ops, flow, layer_of, len(spans))

    nodes: dict[str, OpNode] = {}
    for op in ops:
        io = flow.io[op.index]
        nodes[op.name] = OpNode(
            name=op.name, op=str(op.func),
            inputs=[ops[p].name for p in flow.producers[op.index]],
            input_meta=[_meta(t) for t in op.in_tensors],
            output_meta=[_meta(t) for t in op.out_tensors],
            fwd_flops=op.fwd_flops, bwd_flops=op.bwd_flops,
            bytes_read=op.bytes_read, bytes_written=op.bytes_written,
            params=[] if op.is_view else list(dict.fromkeys(f for _, f in io.params)),
            module_path=op.module_path, module_type=op.module_type,
            layer=layer_of[op.index], saved_bytes=saved.op_bytes.get(op.index, 0),
            saved_is_attention_matrix=op.index in saved.op_attention,
            tp_role=roles[op.index], causal=op.causal)
    a2a = _mark_experts(model, params, batch, len(spans))
    plist = list(params.values())
    layers = [
        Layer(index=k, name=span.name, kind=span.kind,
              nodes=[ops[i].name for i in range(span.start, span.stop)],
              stats=dataclasses.replace(
                  layer_stats(k, ops, span.start, span.stop, flow, roles, plist, saved,
                              entering[k], leaving[k]), moe_a2a_bytes=a2a[k]))
        for k, span in enumerate(spans)]
    return OpGraph(model_name=model_name, fingerprint=fingerprint, batch=batch, nodes=nodes,
                   params=params, layers=layers, dtype=graph_dtype(params))


def trace_module(model: nn.Module, batch: tuple | None = None, *,
                 input_spec: InputSpec | None = None, model_name: str = "model",
                 fingerprint: str | None = None, seq_len: int | None = None) -> OpGraph:
    """Trace one training step of ``model``: ``model(*batch)`` must return the scalar loss.

    Build the model on the meta device (no weight memory); a model on another device
    works too (its tensors are only read as fake tensors, never copied). Give either
    ``batch`` (example tensors on the model's device) or ``input_spec``
    (``[(shape, dtype), ...]``, tensors made on the model's device). ``seq_len`` is
    inferred from a 2-D integer first input (tokens) when not given."""
    if (batch is None) == (input_spec is None):
        raise ConfigError("give exactly one of batch (example tensors) or input_spec "
                          "([(shape, dtype), ...])", field="batch")
    if input_spec is not None:
        first = next(model.parameters(), None)
        batch = _batch_from_spec(input_spec, first.device if first is not None
                                 else torch.device("meta"))
    t0 = time.perf_counter()
    cap = capture(model, tuple(batch))
    graph = _graph_from_capture(model, cap, model_name=model_name,
                                fingerprint=fingerprint or module_fingerprint(model),
                                seq_len=seq_len)
    graph.trace_seconds = time.perf_counter() - t0
    return graph


def trace(spec: Any, batch_size: int, seq_len: int | None = None, *,
          dtype: torch.dtype | None = None) -> OpGraph:
    """Build ``spec`` (an :class:`autoplan.models.ModelSpec`, or a name for
    :func:`autoplan.models.resolve`) on the meta device with its training batch of
    ``batch_size`` (sequence ``seq_len``, default the model's) and trace it.
    ``trace_seconds`` includes building the model."""
    from autoplan.models import build_model, default_seq_len, example_batch, resolve

    t0 = time.perf_counter()
    if isinstance(spec, str):
        spec = resolve(spec)
    if seq_len is None:
        seq_len = default_seq_len(spec)
    model = build_model(spec, device="meta", dtype=dtype)
    batch = example_batch(spec, batch_size, seq_len, device="meta")
    if dtype is not None:       # float inputs (pixels) in the compute dtype, as autocast would
        batch = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                      else t for t in batch)
    graph = trace_module(model, batch, model_name=spec.name, fingerprint=spec.fingerprint(),
                         seq_len=seq_len)
    graph.trace_seconds = time.perf_counter() - t0
    return graph
