"""Activation memory: which tensors backward keeps alive, and whose they are.

The capture records every tensor autograd saves (``saved_tensors_hooks``), with the forward
op that saved it. Here each saved tensor is resolved to its storage (a view keeps its whole
base alive; several views of one storage count once) and to the op that created that
storage. Storages of parameters, buffers and batch inputs are not activations and are
skipped.

Two attributions, for two uses:

* ``OpNode.saved_bytes`` — per *producer*: bytes of this op's outputs that backward keeps.
* ``LayerStats.saved_bytes`` — per *consumer*: a storage counts in the layer whose backward
  needs it (the earliest such layer if several). So a block's own input, saved by its first
  norm, counts in that block, as in Korthikanti et al. 2022 (arXiv 2205.05198), whose
  per-layer total s·b·h·(34 + 5·a·s/h) includes the 2·s·b·h layer input; under pipeline
  parallelism it is the stage running that layer that holds it.

A storage is TP-sharded when its producer is a ``column`` or ``sharded`` op, and an
attention matrix when its tensor has shape (..., s, s) for the traced sequence length s
(the 5·a·s/h term; flash / memory-efficient attention never stores it) -- in a model without
a sequence length (a ViT), a square output of softmax, dropout or a batched matmul, not a
CNN's square feature map.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.graph import TPRole
from autoplan.trace.capture import Capture, storage_key


@dataclass
class SavedSummary:
    op_bytes: dict[int, int]               # producer op index -> bytes of its saved outputs
    op_attention: set[int]                 # producer ops whose saved output is an attention matrix
    layer_bytes: list[int]
    layer_bytes_tp: list[int]
    layer_bytes_attn: list[int]


#: ops whose square output is an attention matrix in a model without a sequence length (a
#: ViT's eager attention saves its softmax and dropout outputs; a CNN's feature maps, also
#: square in their last two dimensions, come from convolutions, norms and activations)
_ATTENTION_PRODUCERS = ("_softmax", "softmax", "_safe_softmax", "native_dropout", "dropout",
                        "bmm", "baddbmm", "matmul")


def _is_attention_shape(shape: tuple[int, ...], seq_len: int | None,
                        producer: str = "") -> bool:
    """(..., s, s) for the traced sequence length s; without one (an image model), a square
    output of one of :data:`_ATTENTION_PRODUCERS`."""
    if len(shape) < 3 or shape[-1] != shape[-2] or shape[-1] <= 1:
        return False
    if seq_len is None:
        parts = producer.split(".")                  # "aten._softmax.default"
        return len(parts) > 1 and parts[1] in _ATTENTION_PRODUCERS
    return shape[-1] == seq_len


def summarize_saved(cap: Capture, layer_of: list[int], roles: list[TPRole], num_layers: int,
                    seq_len: int | None) -> SavedSummary:
    op_bytes: dict[int, int] = {}
    op_attention: set[int] = set()
    layer_bytes = [0] * num_layers
    layer_tp = [0] * num_layers
    layer_attn = [0] * num_layers
    seen: set[int] = set()
    for record in cap.saved:
        if record.storage in seen:
            continue
        owner = cap.owners.get(record.storage)
        if owner is None or owner[0] != "op":
            continue
        seen.add(record.storage)
        producer = owner[1]
        saver = cap.seq_owner.get(record.seq_nr, producer)
        layer = layer_of[saver]
        op_bytes[producer] = op_bytes.get(producer, 0) + record.nbytes
        layer_bytes[layer] += record.nbytes
        if roles[producer] in ("column", "sharded"):
            layer_tp[layer] += record.nbytes
        shape = next((tuple(t.shape) for t in cap.ops[producer].out_tensors
                      if storage_key(t) == record.storage), ())
        if _is_attention_shape(shape, seq_len, str(cap.ops[producer].func)):
            op_attention.add(producer)
            layer_attn[layer] += record.nbytes
    return SavedSummary(op_bytes, op_attention, layer_bytes, layer_tp, layer_attn)
