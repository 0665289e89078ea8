"""Per-layer aggregates (:class:`autoplan.graph.LayerStats`) at the traced micro-batch.

* FLOPs and bytes: sums over the layer's ops; the ``*_tp`` parts are the ops whose role is
  ``column``, ``row`` or ``sharded`` (they do 1/t of the work under TP degree t).
* ``matmul_flops``: forward FLOPs of the ops with a registered FLOP formula (matmul,
  convolution, attention) — the compute-bound part.
* Parameters: each parameter counts once, in the layer of the first op that reads it;
  ``params_tp`` are those with a TP-sharded dim.
* ``input_bytes``: the distinct tensors entering the layer (activations produced by earlier
  layers, batch inputs), which is what full recomputation keeps; ``output_bytes``: the
  distinct tensors it produces that later layers read (the pipeline send size). Tensors
  are deduplicated by storage, each counted at the largest view read.
* ``tp_allreduce_fwd_bytes``: outputs of the row ops (all-reduced in forward under TP);
  ``tp_allreduce_bwd_bytes``: activation inputs of the column ops (their gradient is
  all-reduced in backward) — Megatron's g and f operators. Column ops reading one tensor
  (separate q, k, v projections of one norm output) share one all-reduce: each distinct
  input storage counts once, as with Megatron's fused QKV.
* ``expert_params``: expert weights among the layer's parameters (``ParamInfo.experts``);
  ``moe_a2a_bytes`` (set by the tracer from the MoE modules, :mod:`autoplan.models.moe`):
  one expert all-to-all's bytes; ``kv_bytes``: keys and values entering the layer's
  scaled-dot-product attention (what context parallelism exchanges).
* Saved activations: see :mod:`autoplan.trace.saved`.
"""

from __future__ import annotations

from autoplan.graph import DTYPE_BYTES, LayerStats, ParamInfo, TPRole
from autoplan.trace.capture import CapturedOp, storage_key
from autoplan.trace.dataflow import Dataflow
from autoplan.trace.flops import is_matmul_like, tensor_nbytes
from autoplan.trace.saved import SavedSummary

_TP: frozenset[str] = frozenset({"column", "row", "sharded"})


def boundary_bytes(ops: list[CapturedOp], flow: Dataflow, layer_of: list[int],
                   num_layers: int) -> tuple[list[int], list[int]]:
    """(input_bytes, output_bytes) per layer: tensors crossing into / out of each layer."""
    entering: list[dict[int, int]] = [{} for _ in range(num_layers)]
    leaving: list[dict[int, int]] = [{} for _ in range(num_layers)]
    for op in ops:
        here = layer_of[op.index]
        io = flow.io[op.index]
        for t, producer in io.activations:
            there = layer_of[producer]
            if there < here:
                key, size = storage_key(t), tensor_nbytes(t)
                entering[here][key] = max(entering[here].get(key, 0), size)
                leaving[there][key] = max(leaving[there].get(key, 0), size)
        for t, _ in io.batch_inputs:
            key, size = storage_key(t), tensor_nbytes(t)
            entering[here][key] = max(entering[here].get(key, 0), size)
    return [sum(d.values()) for d in entering], [sum(d.values()) for d in leaving]


# Ops that only reshape, copy or repeat a tensor: grouped-query attention's key/value
# expansion (repeat_interleave, or HF's expand + reshape) is made of them.
_SHAPE_OPS = ("view", "_unsafe_view", "reshape", "expand", "clone", "transpose", "permute",
              "unsqueeze", "contiguous", "repeat_interleave", "repeat", "index_select", "slice",
              "_to_copy", "alias")


def _unexpanded_bytes(t, producer: int | None, ops: list[CapturedOp]) -> int:
    """Bytes of ``t`` before any head expansion: the smallest tensor on the chain of shape
    ops that made it (keys and values are exchanged by context parallelism before
    grouped-query attention repeats them over the query heads)."""
    best = tensor_nbytes(t)
    seen = 0
    while producer is not None and seen < 16:
        op = ops[producer]
        if op.func.__name__.split(".")[0] not in _SHAPE_OPS or not op.in_tensors:
            break
        best = min(best, tensor_nbytes(op.in_tensors[0]))
        producer = op.producers[0] if op.producers else None
        seen += 1
    return best


def layer_stats(index: int, ops: list[CapturedOp], start: int, stop: int, flow: Dataflow,
                roles: list[TPRole], params: list[ParamInfo], saved: SavedSummary,
                input_bytes: int, output_bytes: int) -> LayerStats:
    fwd = bwd = fwd_tp = bwd_tp = mm = moved = moved_tp = 0.0
    ar_fwd = kv = 0
    column_inputs: dict[int | None, int] = {}     # storage -> bytes
    for op in ops[start:stop]:
        role = roles[op.index]
        bytes_ = op.bytes_read + op.bytes_written
        fwd += op.fwd_flops
        bwd += op.bwd_flops
        moved += bytes_
        if role in _TP:
            fwd_tp += op.fwd_flops
            bwd_tp += op.bwd_flops
            moved_tp += bytes_
        if is_matmul_like(op.func):
            mm += op.fwd_flops
        if "scaled_dot_product" in str(op.func) and len(op.in_tensors) >= 3:
            kv += sum(_unexpanded_bytes(op.in_tensors[i], op.producers[i], ops)
                      for i in (1, 2))
        if op.is_view:          # views of weights take their op's role but move nothing
            continue
        if role == "row":
            ar_fwd += sum(tensor_nbytes(t) for t in op.out_tensors)
        elif role == "column":
            io = flow.io[op.index]
            for t in [t for t, _ in io.activations] + [t for t, _ in io.batch_inputs]:
                column_inputs[storage_key(t)] = max(column_inputs.get(storage_key(t), 0),
                                                    tensor_nbytes(t))
    mine = [p for p in params if p.layer == index]
    return LayerStats(
        fwd_flops=fwd, bwd_flops=bwd, fwd_flops_tp=fwd_tp, bwd_flops_tp=bwd_tp,
        matmul_flops=mm, bytes_moved=moved, bytes_moved_tp=moved_tp,
        params=sum(p.numel for p in mine),
        params_tp=sum(p.numel for p in mine if p.tp_dim is not None),
        param_bytes=sum(p.numel * DTYPE_BYTES.get(p.dtype, 4) for p in mine),
        saved_bytes=saved.layer_bytes[index], saved_bytes_tp=saved.layer_bytes_tp[index],
        saved_bytes_attn=saved.layer_bytes_attn[index],
        input_bytes=input_bytes, output_bytes=output_bytes,
        tp_allreduce_fwd_bytes=ar_fwd, tp_allreduce_bwd_bytes=sum(column_inputs.values()),
        expert_params=sum(p.numel for p in mine if p.experts),
        expert_params_tp=sum(p.numel for p in mine if p.experts and p.tp_dim is not None),
        kv_bytes=kv)
